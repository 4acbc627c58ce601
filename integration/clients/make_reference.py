"""Measure the client scenarios under real DeepSpeed and write ``reference.json``.

Run it with an interpreter whose ``deepspeed`` is real DeepSpeed (never ds), on CPU::

    python -m venv /tmp/dsref
    DS_BUILD_OPS=0 /tmp/dsref/bin/pip install deepspeed==0.19.8 transformers==5.24.0 \\
        accelerate==1.15.0 lightning==2.6.6 torch --index-url ... (CPU torch)
    DS_ACCELERATOR=cpu /tmp/dsref/bin/python integration/clients/make_reference.py

(see docs/clients.md). It runs every scenario of ``_launch.SCENARIOS`` on 2 ranks, exactly as the
tests do, and records each rank's per-step losses plus what each scenario reports about itself.
``--only NAME`` re-measures some scenarios and keeps the others' numbers.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import _launch

REFERENCE = _launch.HERE / "reference.json"
VERSIONED = ("deepspeed", "torch", "transformers", "accelerate", "lightning")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="scenario names to (re)measure")
    parser.add_argument("--output", type=Path, default=REFERENCE)
    args = parser.parse_args()
    if importlib.util.find_spec("ds_engine") is not None:
        sys.exit("make_reference.py must run under real DeepSpeed: this interpreter has ds_engine")

    reference = json.loads(args.output.read_text()) if args.output.exists() else {"scenarios": {}}
    reference["measured_with"] = {name: metadata.version(name) for name in VERSIONED}
    names = args.only or list(_launch.SCENARIOS)
    outs: dict[str, Path] = {}
    with tempfile.TemporaryDirectory(prefix="clients-ref-") as tmp:
        for name in _launch.SCENARIOS:
            needed_by = [other for other in names if _launch.SCENARIOS[other][2] == name]
            if name not in names and not needed_by:
                continue
            start = _launch.SCENARIOS[name][2]
            run = _launch.run_scenario(name, Path(tmp) / name, outs.get(start) if start else None)
            outs[name] = run.out
            print(
                f"{name}: {run.seconds:.1f}s, rank 0 losses {[round(x, 4) for x in run.losses[0]]}"
            )
            if name in names:
                reference["scenarios"][name] = {
                    "losses": run.losses,
                    "reported": [
                        {k: v for k, v in r.items() if k != "losses"} for r in run.results
                    ],
                }
    args.output.write_text(json.dumps(reference, indent=1) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
