"""FLOPs of the example GPT (one Block, and the whole model) under a flops profiler and under
``torch.utils.flop_counter.FlopCounterMode``, printed as JSON (docs/profiling.md's table).

    uv run python tools/examples/gpt/flops_crosscheck.py ds
    DS_ACCELERATOR=cpu /path/to/deepspeed-venv/bin/python tools/examples/gpt/flops_crosscheck.py deepspeed

``ds`` uses ``ds_engine.profiling.flops_profiler``; ``deepspeed`` real DeepSpeed's (ds_engine is
then not importable: an empty stand-in lets ``train.py`` load).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode


def main(which: str) -> dict:
    if which == "deepspeed":
        sys.modules.setdefault("ds_engine", types.ModuleType("ds_engine"))
        from deepspeed.profiling.flops_profiler import get_model_profile
    elif which == "ds":
        from ds_engine.profiling.flops_profiler import get_model_profile
    else:
        raise SystemExit(f"usage: flops_crosscheck.py ds|deepspeed (got {which!r})")
    spec = importlib.util.spec_from_file_location(
        "gpt_example", Path(__file__).with_name("train.py")
    )
    assert spec is not None and spec.loader is not None
    gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt)
    torch.manual_seed(0)
    cases = (
        ("block", gpt.Block(32, 4), [torch.randn(2, 16, 32)]),
        (
            "gpt",
            gpt.GPT(vocab=64, seq=16, dim=32, layers=2, heads=4),
            [torch.randint(0, 64, (2, 17))],
        ),
    )
    out = {"torch": torch.__version__}
    for name, model, args in cases:
        model.eval()
        with FlopCounterMode(display=False) as counter:
            model(*args)
        flops, macs, params = get_model_profile(
            model, args=args, print_profile=False, as_string=False
        )
        out[name] = {
            "flops": flops,
            "macs": macs,
            "params": params,
            "FlopCounterMode": counter.get_total_flops(),
        }
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1] if len(sys.argv) > 1 else "ds"), indent=1))
