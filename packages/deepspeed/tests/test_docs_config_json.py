"""Every config example on DeepSpeed's config-json page (https://www.deepspeed.ai/docs/config-json/)
under the opt-in ``deepspeed`` package.

``docs_examples/config_json_examples.json`` holds each JSON snippet of the page (transcribed as
data, with the section it came from) and the page's other documented settings at a value that
asks for them. Each is merged into a minimal base config and given to ``deepspeed.initialize``
on 2 gloo ranks. The fixture's expectation table says what must happen, so a regression either
way fails:

- ``trains``: the engine is built and trains: at least 2 optimizer steps are applied and the
  weights move, within 40 steps (an fp16 config skips its first steps on overflow, and the
  page's WarmupLR starts at lr 0, in DeepSpeed as in ds), with finite losses;
- ``refused``: ``initialize`` raises the "not implemented in ds" error naming ``refused_key``
  (see [Note: refused only when requested] in ``ds_engine._config_features``);
- ``gap``: what DeepSpeed does (trains) is expected but ds still lacks something: a strict
  xfail naming it, so the entry fails loudly once the gap closes.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest

from ds_testing import run_on_ranks

FIXTURE = Path(__file__).parent / "docs_examples" / "config_json_examples.json"
DOC = json.loads(FIXTURE.read_text())
WORLD_SIZE = 2
APPLIED = 2  # optimizer steps that must be applied (not skipped for an fp16 overflow)
MAX_STEPS = 40  # fp16's first steps may overflow; WarmupLR starts at lr 0 (as in DeepSpeed)


def merged(base: dict[str, Any], snippet: dict[str, Any]) -> dict[str, Any]:
    """``snippet`` over ``base``: sections merged key by key, anything else replaced."""
    out = copy.deepcopy(base)
    for key, value in snippet.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _with_nvme_dir(value: Any, nvme_dir: str) -> Any:
    """The page's placeholder ``/local_nvme`` replaced by a real directory, and the monitors'
    relative ``output_path`` put under it (not into the working directory)."""
    if isinstance(value, dict):
        out = {k: _with_nvme_dir(v, nvme_dir) for k, v in value.items()}
        if isinstance(out.get("output_path"), str) and not out["output_path"].startswith("/"):
            out["output_path"] = f"{nvme_dir}/{out['output_path']}"
        return out
    return nvme_dir if value == "/local_nvme" else value


def _make_model():
    import torch

    class Net(torch.nn.Module):
        """Two linear layers; casts its input to the weights' dtype (fp16/bf16 engines)."""

        def __init__(self) -> None:
            super().__init__()
            self.fc1 = torch.nn.Linear(8, 16)
            self.fc2 = torch.nn.Linear(16, 1)

        def forward(self, x, y):
            hidden = torch.relu(self.fc1(x.to(self.fc1.weight.dtype)))
            return torch.nn.functional.mse_loss(self.fc2(hidden).float(), y)

    torch.manual_seed(0)
    return Net()


def _initialize_and_train(rank: int, world_size: int, *, config: dict[str, Any]) -> dict[str, Any]:
    """``deepspeed.initialize`` with ``config``; on success, train until ``APPLIED`` optimizer
    steps were applied and the weights moved (at most ``MAX_STEPS`` steps)."""
    import deepspeed
    import torch

    model = _make_model()
    try:
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
    except Exception as error:  # the refusal (or any failure) is the result
        return {"error": f"{type(error).__name__}: {error}"}
    generator = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(engine.train_micro_batch_size_per_gpu(), 8, generator=generator)
    y = torch.randn(engine.train_micro_batch_size_per_gpu(), 1, generator=generator)
    with torch.no_grad():
        before = engine(x, y).item()
    losses, after = [], before
    while engine.global_steps < MAX_STEPS:
        for _ in range(engine.gradient_accumulation_steps()):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        with torch.no_grad():
            after = engine(x, y).item()
        moved = torch.tensor([float(after != before)])
        deepspeed.comm.all_reduce(moved, op=deepspeed.comm.ReduceOp.MIN)  # ranks stop together
        if engine.global_steps - engine.skipped_steps >= APPLIED and moved.item():
            break
    result = {
        "error": None,
        "global_steps": engine.global_steps,
        "skipped_steps": engine.skipped_steps,
        "losses": losses,
        "before": before,
        "after": after,
    }
    engine.destroy()
    return result


def _cases() -> list[Any]:
    cases = []
    for entry in DOC["examples"]:
        marks = []
        if entry["expect"] == "gap":
            marks.append(pytest.mark.xfail(strict=True, reason=entry["gap"]))
        cases.append(pytest.param(entry, id=entry["id"], marks=marks))
    return cases


def test_expectation_table_is_complete() -> None:
    ids = [e["id"] for e in DOC["examples"]]
    assert len(ids) == len(set(ids)), "duplicate ids"
    for entry in DOC["examples"]:
        assert entry["kind"] in ("snippet", "setting"), entry["id"]
        assert entry["section"], entry["id"]
        assert entry["expect"] in ("trains", "refused", "gap"), entry["id"]
        assert (entry["expect"] == "refused") == ("refused_key" in entry), entry["id"]
        assert "refused_because" not in entry or entry["expect"] == "refused", entry["id"]
        assert (entry["expect"] == "gap") == bool(entry.get("gap")), entry["id"]


@pytest.mark.parametrize("entry", _cases())
def test_config_example(entry: dict[str, Any], tmp_path: Path) -> None:
    config = _with_nvme_dir(merged(DOC["base"], entry["config"]), str(tmp_path))
    results = run_on_ranks(
        _initialize_and_train,
        WORLD_SIZE,
        config=config,
        fresh=entry.get("fresh", False),
        timeout=300,
        # the W&B example logs offline, into the test's folder
        env={"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"},
    )
    if entry["expect"] == "refused":
        key = entry["refused_key"]
        because = entry.get("refused_because", "not implemented in ds")
        for result in results:
            error = result["error"]
            assert error is not None, f"{entry['id']}: accepted, expected a refusal of {key!r}"
            assert because in error and key in error, error
        return
    for result in results:
        assert result["error"] is None, f"{entry['id']}: {result['error']}"
        assert result["global_steps"] - result["skipped_steps"] >= APPLIED, result
        assert result["after"] != result["before"], result  # the applied steps moved the weights
        assert all(math.isfinite(loss) for loss in result["losses"]), result
