"""The model, data and loop of ``tools/compat/make_deepspeed_checkpoints.py``, for ds.

The fixtures under ``fixtures/deepspeed_0.19.8`` (every case) and ``fixtures/deepspeed_0.16.9``
(a few ZeRO cases, the oldest DeepSpeed ds reads) were written by real DeepSpeed with that
script; these helpers rebuild the same model and batches so ds can resume them and compare its
losses with the ones DeepSpeed recorded in ``expected.json``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

LATEST = "0.19.8"
OLDEST = "0.16.9"
VERSIONS = (LATEST, OLDEST)  # the DeepSpeed releases whose checkpoints the tests read


def fixtures(version: str = LATEST) -> Path:
    """The folder of checkpoints DeepSpeed ``version`` wrote."""
    return Path(__file__).parent / "fixtures" / f"deepspeed_{version}"


FIXTURES = fixtures()
DSREF_PYTHON = Path("/tmp/dsref/bin/python")
GENERATOR = Path(__file__).parents[3] / "tools" / "compat" / "make_deepspeed_checkpoints.py"
# The model, data and sizes the fixtures were made with: the generating script's own, so the two
# cannot drift (it imports only torch at module level).
_MAKER = Path(__file__).resolve().parents[3] / "tools" / "compat" / "make_deepspeed_checkpoints.py"
_spec = importlib.util.spec_from_file_location("make_deepspeed_checkpoints", _MAKER)
assert _spec is not None and _spec.loader is not None, _MAKER
_maker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_maker)
Net, batch = _maker.Net, _maker.batch
IN, HIDDEN, MID, OUT, GLOBAL_BATCH = (
    _maker.IN,
    _maker.HIDDEN,
    _maker.MID,
    _maker.OUT,
    _maker.GLOBAL_BATCH,
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def run_deepspeed(script: Path, *args: str) -> dict[str, Any]:
    """``script`` run by real DeepSpeed (``DSREF_PYTHON``, on the CPU) with ``args``: the
    ``RESULT {json}`` it prints. Skips where DeepSpeed refuses the dtype on this CPU (its CPU
    accelerator allows fp16 only where oneDNN does it); any other error fails, with its output."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "DS_BUILD_OPS": "0"}
    command = [str(DSREF_PYTHON), str(script), *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    error = str(result.get("error", ""))
    if "is not supported on your device" in error:
        pytest.skip(f"real DeepSpeed refuses this on this CPU: {error}")
    assert not error, error + done.stderr[-3000:]
    return result


def expected(version: str = LATEST) -> dict[str, Any]:
    return json.loads((fixtures(version) / "expected.json").read_text())


def config_for(case: dict[str, Any], world: int, stage: int | None = None) -> dict[str, Any]:
    """The case's DeepSpeed config for ``world`` ranks (and another ZeRO stage if given)."""
    cfg = json.loads(json.dumps(case["config"]))
    cfg["train_micro_batch_size_per_gpu"] = GLOBAL_BATCH // world
    if stage is not None:
        cfg["zero_optimization"]["stage"] = stage
    return cfg


def build_engine(cfg: dict[str, Any], seed: int = 99):
    import ds_engine as deepspeed

    torch.manual_seed(seed)  # not the fixture's init: the checkpoint must overwrite it
    model = Net()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def train(engine, first: int, count: int, rank: int, world: int, dtype: str) -> list[float]:
    """``count`` steps from global step ``first``; each loss averaged over the global batch."""
    import ds_comm

    losses = []
    for step in range(first, first + count):
        x, y = batch(step, rank, world)
        loss = engine(x.to(DTYPES[dtype]), y)
        engine.backward(loss)
        engine.step()
        value = loss.detach().float().clone()
        ds_comm.all_reduce(value)
        losses.append(value.item() / world)
    return losses


def copy_case(name: str, dest: Path) -> Path:
    shutil.copytree(FIXTURES / name, dest / name)
    return dest / name


def pipe_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out.float() - y.float()) ** 2).mean()


def build_pipe_engine(cfg: dict[str, Any], seed: int = 99, num_stages: int = 1):
    """The fixture's ``PipelineModule`` (Linear, Tanh, Linear, Tanh, Linear), one stage or cut
    uniformly into ``num_stages``."""
    import ds_engine as deepspeed
    from ds_engine.pipe import LayerSpec, PipelineModule

    torch.manual_seed(seed)
    layers = [
        LayerSpec(torch.nn.Linear, IN, HIDDEN),
        torch.nn.Tanh(),
        LayerSpec(torch.nn.Linear, HIDDEN, MID),
        torch.nn.Tanh(),
        LayerSpec(torch.nn.Linear, MID, OUT),
    ]
    model = PipelineModule(
        layers=layers, num_stages=num_stages, loss_fn=pipe_loss, partition_method="uniform"
    )
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def train_pipe(
    engine, first: int, count: int, rank: int, world: int, data: tuple[int, int] | None = None
) -> list[float]:
    """``count`` pipeline batches; ``data`` = (rank, ranks) of the batch split (default: this
    rank's share of ``world``; ``(0, 1)`` for a pipeline with one data-parallel rank)."""
    import ds_comm

    data_rank, data_world = data or (rank, world)
    losses = []
    for step in range(first, first + count):
        loss = engine.train_batch(data_iter=iter([batch(step, data_rank, data_world)]))
        value = loss.detach().float().clone()
        ds_comm.all_reduce(value)
        losses.append(value.item() / world)
    return losses


class MoENet(torch.nn.Module):
    """The fixture's fc1, MoE layer of two linear experts (top-1 gate), fc3."""

    def __init__(self, ep_size: int) -> None:
        from ds_engine.moe.layer import MoE

        super().__init__()
        self.fc1 = torch.nn.Linear(IN, MID)
        expert = torch.nn.Linear(MID, MID)
        self.moe = MoE(hidden_size=MID, expert=expert, num_experts=2, ep_size=ep_size, k=1)
        self.fc3 = torch.nn.Linear(MID, OUT)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        h, _, _ = self.moe(h)
        return ((self.fc3(torch.tanh(h)).float() - y.float()) ** 2).mean()


class MultiMoENet(torch.nn.Module):
    """The resume script's two MoE layers: two experts at ``ep_size`` 1, four at ``ep_size`` 2."""

    def __init__(self) -> None:
        from ds_engine.moe.layer import MoE

        super().__init__()
        self.fc1 = torch.nn.Linear(IN, MID)
        self.moe_a = MoE(MID, torch.nn.Linear(MID, MID), num_experts=2, ep_size=1, k=1)
        self.moe_b = MoE(MID, torch.nn.Linear(MID, MID), num_experts=4, ep_size=2, k=1)
        self.fc3 = torch.nn.Linear(MID, OUT)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        h = torch.tanh(self.moe_a(h)[0])
        h = torch.tanh(self.moe_b(h)[0])
        return ((self.fc3(h).float() - y.float()) ** 2).mean()


def build_moe_engine(
    cfg: dict[str, Any], world: int, seed: int = 99, *, ep_size: int | None = None, multi=False
):
    """The MoE model (``ep_size`` default: the world size), or :class:`MultiMoENet`."""
    import ds_engine as deepspeed
    from ds_engine.moe.utils import split_params_into_different_moe_groups_for_optimizer

    torch.manual_seed(seed)
    model = MultiMoENet() if multi else MoENet(ep_size=ep_size or world)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "params"}
    )
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
    return engine
