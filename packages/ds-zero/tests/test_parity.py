"""Training parity: ZeRO stages 0/1/2 on 1, 2 and 4 gloo ranks give the parameters of
single-process training on the full batch, computed inside each rank.

Every dimension (stage, overlap_comm, gradient accumulation 1/4, fp32/bf16, CPU offload, world
size) is covered by the default run; the full cross product is marked slow. One harness call
runs a list of configurations, so the workers and the reference are reused.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _ds_zero_testing import (
    Recipe,
    adam,
    cpu_adam,
    global_batches,
    make_model,
    micro_batches,
    parameter_error,
    reference_train,
)

STEPS = 10  # enough steps for Adam state and accumulation to matter; parity is exact per step
ROWS = 16  # global batch: divisible by world size x accumulation steps
# fp32: elementwise, relative to the tensor's largest element. bf16: relative L2 per tensor (see
# parameter_error); bf16's own distance from fp32 training is about 2e-2 here.
TOLERANCE = {"fp32": 1e-5, "bf16": 5e-2}

# (stage, overlap_comm, gradient accumulation, dtype, offload)
Config = tuple[int, bool, int, str, bool]


def _train(
    rank: int, world_size: int, config: Config, *, bucket: int, extra: dict | None = None
) -> float:
    import torch

    from ds_zero import ZeroConfig, ZeroOptimizer

    stage, overlap, accum, dtype_name, offload = config
    dtype = getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[dtype_name])
    model = make_model(dtype)
    section = {
        "stage": stage,
        "overlap_comm": overlap,
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
        "offload_optimizer": {"device": "cpu" if offload else "none"},
        **(extra or {}),
    }
    # ZeRO-Offload steps with CPUAdam (DeepSpeed's engine picks DeepSpeedCPUAdam for it).
    optimizer = cpu_adam(list(model.parameters())) if offload else adam(list(model.parameters()))
    zero = ZeroOptimizer(
        model,
        optimizer,
        ZeroConfig.from_dict(section),
        gradient_accumulation_steps=accum,
    )
    for batch in global_batches(STEPS, ROWS):
        for micro in micro_batches(batch, rank, world_size, accum):
            zero.backward(model(micro))
            skipped = zero.step().skipped
            assert not skipped
    return parameter_error(model, _reference(dtype))


_REFERENCES: dict = {}  # per dtype; workers are reused, so later calls skip the reference run


def _reference(dtype):
    if dtype not in _REFERENCES:
        batches = global_batches(STEPS, ROWS)
        _REFERENCES[dtype] = reference_train(make_model(dtype), batches, Recipe(adam))
    return _REFERENCES[dtype]


def _parity_body(
    rank: int, world_size: int, *, configs: list[Config], bucket: int, extra: dict | None = None
) -> list[float]:
    errors = []
    for config in configs:
        error = _train(rank, world_size, config, bucket=bucket, extra=extra)
        assert error <= TOLERANCE[config[3]], f"{config} {extra}: relative error {error:.3g}"
        errors.append(error)
    return errors


# Each line covers stages 0/1/2, overlap on/off, accumulation 1/4, fp32/bf16, offload on/off.
DEFAULT: list[Config] = [
    (0, False, 1, "fp32", False),
    (0, True, 4, "bf16", False),
    (1, True, 1, "fp32", False),
    (1, False, 4, "bf16", True),
    (2, True, 4, "fp32", False),
    (2, False, 1, "bf16", False),
    (2, True, 1, "fp32", True),
]
EVERY: list[Config] = [
    c
    for c in itertools.product((0, 1, 2), (False, True), (1, 4), ("fp32", "bf16"), (False, True))
    if not (c[0] == 0 and c[4])  # offload needs a sharded optimizer
]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_parameters_match_single_process_training(world_size: int) -> None:
    # A bucket of 1500 elements cuts the model into many units (overlap has work to overlap).
    errors = run_on_ranks(_parity_body, world_size, configs=DEFAULT, bucket=1500, timeout=600)
    assert len(errors) == world_size


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_parameters_match_single_process_training_every_combination(world_size: int) -> None:
    run_on_ranks(_parity_body, world_size, configs=EVERY, bucket=1500, timeout=1800)


# The other ways to communicate: all-reduce instead of reduce-scatter, broadcasts instead of
# all-gather, gradients flattened at reduction time instead of staged, and all-gather buckets
# that split units (small) or span several (large).
VARIANTS = [
    {"reduce_scatter": False},
    {"allgather_partitions": False},
    {"contiguous_gradients": False},
    {"allgather_bucket_size": 700},
    {"allgather_bucket_size": 10**6},
]


# Each variant at 2 ranks in the default run; at 4 ranks in the slow tier (the 4-rank paths of the
# default layout are covered by test_parameters_match_single_process_training[4]).
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "extra", VARIANTS, ids=lambda e: next(iter(e)) + "=" + str(next(iter(e.values())))
)
def test_communication_variants_match_single_process_training(world_size: int, extra: dict) -> None:
    configs: list[Config] = [(1, True, 4, "fp32", False), (2, True, 4, "fp32", False)]
    run_on_ranks(_parity_body, world_size, configs=configs, bucket=1500, extra=extra, timeout=600)


def grouped_adamw(params: list) -> object:
    """AdamW with weight decay on matrices only: two param groups (frozen tensors included)."""
    import torch

    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.99))


def _groups_body(rank: int, world_size: int, *, stage: int) -> float:
    import torch

    from ds_zero import ZeroConfig, ZeroOptimizer

    def frozen_model():
        model = make_model(torch.float32)
        model.pos.weight.requires_grad_(False)
        return model

    model = frozen_model()
    config = ZeroConfig(stage=stage, reduce_bucket_size=1500, overlap_comm=True)
    zero = ZeroOptimizer(model, grouped_adamw(list(model.parameters())), config)
    assert len(zero.groups) == 2
    for batch in global_batches(STEPS, ROWS):
        zero.backward(model(next(micro_batches(batch, rank, world_size, 1))))
        zero.step()
    reference = reference_train(frozen_model(), global_batches(STEPS, ROWS), Recipe(grouped_adamw))
    assert torch.equal(model.pos.weight, reference["pos.weight"])  # frozen: untouched
    return parameter_error(model, reference)


@pytest.mark.parametrize("world_size", [1, 4])
@pytest.mark.parametrize("stage", [0, 2])
def test_param_groups_and_frozen_parameters(world_size: int, stage: int) -> None:
    errors = run_on_ranks(_groups_body, world_size, stage=stage, timeout=600)
    assert max(errors) <= TOLERANCE["fp32"]
