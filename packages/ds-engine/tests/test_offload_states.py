"""``engine.offload_states()`` / ``reload_states()`` (the RLHF phase switch) on real gloo ranks at
every ZeRO stage: the state leaves the compute device (its storages are freed) and training after
the reload continues bit for bit as a run that never offloaded."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _engine_testing import config, loss_of, make_dataset, make_mlp

# (stage, dtype): every stage, the low-precision layouts (separate fp32 masters) included.
CASES = [(0, "fp32"), (1, "bf16"), (2, "bf16"), (3, "bf16")]
MORE_CASES = [(0, "bf16"), (2, "fp32"), (3, "fp32")]
STEPS = 3


def _engine(stage: int, dtype: str, **zero: object):
    import ds_engine

    section: dict = {"stage": stage, **zero}
    if stage == 3:
        section.setdefault("stage3_param_persistence_threshold", 0)
    extra: dict = {"bf16": {"enabled": True}} if dtype == "bf16" else {}
    model = make_mlp(seed=3)
    engine, *_ = ds_engine.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=config(zero_optimization=section, **extra),
    )
    return engine


def _train(engine, batches) -> list[float]:
    losses = []
    for batch in batches:
        loss = loss_of(engine, batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _batches(rank: int, steps: int):
    data = make_dataset(64, seed=5)
    return [
        [t[rank * 4 + 8 * i : rank * 4 + 8 * i + 4] for t in data.tensors] for i in range(steps)
    ]


def _offload_body(rank: int, world_size: int, *, cases, include, pin_memory, non_blocking) -> list:
    import weakref

    import torch

    import ds_zero
    from ds_engine.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
    from ds_engine.runtime.zero.offload_states import get_state_devices

    batches = _batches(rank, 2 * STEPS)
    report = []
    for stage, dtype in cases:
        reference = _engine(stage, dtype)
        want = _train(reference, batches)
        want_params = [p.detach().clone() for p in reference.module.parameters()]
        del reference

        engine = _engine(stage, dtype)
        got = _train(engine, batches[:STEPS])
        kinds = None if include is None else [OffloadStateTypeEnum(k) for k in include]
        before = ds_zero.resident_state_bytes(engine.optimizer)
        moved = [
            t
            for kind, ts in ds_zero.state_tensors(engine.optimizer).items()
            if kinds is None or kind in kinds
            for t in ts
            if t.untyped_storage().nbytes() > 0
        ]
        originals = [weakref.ref(t.untyped_storage()) for t in moved]
        identities = [id(t) for t in moved]
        # Aliases the optimizer does not know about (a caller's detached weights) move too.
        stray = [p.detach() for p in engine.module.parameters() if p.numel() > 0]
        engine.offload_states(
            include=kinds,
            device=OffloadDeviceEnum.cpu,
            pin_memory=pin_memory,
            non_blocking=non_blocking,
        )
        after = ds_zero.resident_state_bytes(engine.optimizer)
        freed = sum(r() is None for r in originals)
        for kind in kinds or list(OffloadStateTypeEnum):
            assert after[kind] == 0, (stage, dtype, kind, after)
            assert get_state_devices(engine, kind) <= {torch.device("cpu")}
        assert freed == len(originals), (stage, dtype, freed, len(originals))
        assert ds_zero.offloaded_states(engine.optimizer) == set(kinds or OffloadStateTypeEnum)
        engine.reload_states(non_blocking=non_blocking)
        assert ds_zero.resident_state_bytes(engine.optimizer) == before
        assert [id(t) for t in moved] == identities
        live = [p for p in engine.module.parameters() if p.numel() > 0]
        assert all(a.data_ptr() == p.data_ptr() for a, p in zip(stray, live))
        got += _train(engine, batches[STEPS:])
        same = got == want and all(
            torch.equal(p, q) for p, q in zip(engine.module.parameters(), want_params)
        )
        assert same, (stage, dtype, got, want)
        report.append((stage, dtype, sum(before.values()), sum(after.values())))
    return report


@pytest.mark.parametrize(
    ("cases", "include", "pin_memory", "non_blocking"),
    [
        (CASES, None, True, False),
        (CASES[2:], ["optim_states", "lp_grads"], False, True),
        pytest.param(MORE_CASES, None, False, False, marks=pytest.mark.slow),
        pytest.param(MORE_CASES, ["hp_params", "lp_params"], True, True, marks=pytest.mark.slow),
    ],
    ids=["all", "some-async", "more-all", "more-params"],
)
def test_offload_reload_every_stage_is_bit_identical(cases, include, pin_memory, non_blocking):
    reports = run_on_ranks(
        _offload_body,
        2,
        cases=cases,
        include=include,
        pin_memory=pin_memory,
        non_blocking=non_blocking,
        timeout=300,
    )
    for stage, dtype, before, after in reports[0]:
        assert before > 0 and after < before, (stage, dtype, before, after)


def _refusal_body(rank: int, world_size: int) -> list[str]:
    import ds_engine

    messages = []
    engine = _engine(1, "fp32")
    for call in (
        lambda: engine.offload_states(device="nvme"),
        lambda: engine.offload_states(include=["moments"]),
    ):
        with pytest.raises(ValueError) as error:
            call()
        messages.append(str(error.value))
    engine.offload_states(device="none")  # DeepSpeed warns and moves nothing
    model = make_mlp()
    no_optimizer = {k: v for k, v in config().items() if k != "optimizer"}
    inference, *_ = ds_engine.initialize(model=model, config=no_optimizer)
    with pytest.raises(ValueError) as error:
        inference.offload_states()
    messages.append(str(error.value))
    return messages


def test_offload_states_refusals_name_the_argument():
    nvme, unknown, no_optimizer = run_on_ranks(_refusal_body, 2, timeout=120)[0]
    assert "device='nvme'" in nvme and "'cpu'" in nvme
    assert "'moments'" in unknown and "optim_states" in unknown
    assert "no optimizer" in no_optimizer


def _gpu_body(rank: int, world_size: int, *, stage: int) -> tuple[int, int, int, int]:
    import torch

    import ds_zero
    from ds_comm.accelerator import get_accelerator

    torch.cuda.set_device(0)
    engine = _engine(stage, "bf16")
    batches = [[t.cuda() for t in b] for b in _batches(0, 2)]
    _train(engine, batches)
    torch.cuda.synchronize()
    state = sum(ds_zero.resident_state_bytes(engine.optimizer).values())
    before = torch.cuda.memory_allocated()
    engine.offload_states()
    after = torch.cuda.memory_allocated()
    assert get_accelerator().is_pinned(engine.optimizer.masters[0])
    engine.reload_states()
    reloaded = torch.cuda.memory_allocated()
    _train(engine, batches)
    return state, before, after, reloaded


@pytest.mark.gpu
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_offload_states_frees_gpu_memory(stage):
    state, before, after, reloaded = run_on_ranks(_gpu_body, 1, stage=stage, timeout=300)[0]
    assert state > 0
    # Allocations are rounded up to the allocator's block size: at least the state's bytes go.
    assert before - after >= state, (state, before, after)
    assert reloaded - after >= state, (state, after, reloaded)
