"""ZeRO-Infinity at the optimizer: stage 3 with the optimizer state on NVMe
(``offload_optimizer.device = "nvme"``), alone and with the parameter shards on NVMe too, trains
exactly like CPU offload; the next sub-group's state is read while the current one steps; the
host memory it uses is itemised. And stage 3's ``norm_group``/``norm_exclude`` give the norm and
the weights of stage 2 with the same arguments.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _ds_zero_testing import cpu_adam, global_batches, make_model, micro_batches

STEPS, ROWS = 4, 8
SUB_GROUP = 5000  # several master sub-groups, so the swap pipeline has something to overlap


class RecordingSwapper:
    """ds-offload-aio's swapper, recording the order of its calls (``in``/``out`` and the
    sub-group of each path)."""

    def __init__(self, events: list) -> None:
        import ds_offload_aio as aio

        pool = aio.PinnedBufferPool(buffer_bytes=1 << 16, count=4)
        self.inner = aio.AsyncTensorSwapper(aio.AioHandle(), pool)
        self.events = events

    @property
    def pinned_bytes(self) -> int:
        return self.inner.pinned_bytes

    @staticmethod
    def _groups(paths) -> list[int]:
        return sorted({int(Path(p).name.split("_")[0].removeprefix("group")) for p in paths})

    def swap_out(self, tensors, paths, *, async_op=False) -> None:
        self.events.append(("out", self._groups(paths)))
        self.inner.swap_out(tensors, paths, async_op=async_op)

    def swap_in(self, tensors, paths, *, async_op=False) -> None:
        self.events.append(("in", self._groups(paths)))
        self.inner.swap_in(tensors, paths, async_op=async_op)

    def wait(self) -> int:
        return self.inner.wait()


def _train(rank: int, world_size: int, where: str, root: Path, events: list | None) -> dict:
    import torch

    from ds_zero import Stage3Optimizer, ZeroConfig

    model = make_model(torch.float32)
    optimizer_offload: dict = {"device": where}
    param_offload: dict = {"device": "cpu"}
    if where == "nvme":
        optimizer_offload["nvme_path"] = str(root / "optimizer")
        if events is None:  # ZeRO-Infinity: the parameter shards on NVMe too
            param_offload = {"device": "nvme", "nvme_path": str(root / "params"), "max_in_cpu": 0}
    config = ZeroConfig.from_dict(
        {
            "stage": 3,
            "reduce_bucket_size": 2000,
            "stage3_param_persistence_threshold": 100,
            "sub_group_size": SUB_GROUP,
            "offload_optimizer": optimizer_offload,
            "offload_param": param_offload,
        }
    )
    params = list(model.parameters())
    optimizer = cpu_adam(params)
    swapper = RecordingSwapper(events) if events is not None else None
    zero = Stage3Optimizer(model, optimizer, config, swapper=swapper)
    if events is not None:
        masters = {id(m): i for i, m in enumerate(zero.masters)}

        def record(opt, args, kwargs) -> None:
            stepped = [masters[id(m)] for g in opt.param_groups for m in g["params"]]
            events.append(("step", stepped))

        optimizer.register_step_pre_hook(record)
    losses = []
    for batch in global_batches(STEPS, ROWS):
        loss = model(next(micro_batches(batch, rank, world_size, 1)))
        zero.backward(loss)
        assert zero.step().applied
        losses.append(loss.item())
        if where == "nvme":  # between steps the moments are in files, not in memory
            assert zero._optimizer_state_bytes()["optimizer_state"] == 0
    host = zero.host_memory()
    assert sum(host.values()) == zero.memory_breakdown().host
    result: dict = {"losses": losses, "host": host, "sub_groups": len(zero.masters)}
    if where == "nvme":
        assert zero._swap is not None
        if events is not None:
            events.append(("trained", []))
        result["writes"] = zero._swap.writes
        folder = root / "optimizer" / "ds_zero" / f"rank{rank}"
        result["files"] = sorted(p.name for p in folder.iterdir())
        store = zero.partitioner.shard_store
        result["param_reads"] = store.reads if store is not None else None
        saved = zero.state_dict()  # swaps in to read the moments, and out again
        result["moments"] = sorted(saved["optimizer"]["state"][0])
        assert zero._optimizer_state_bytes()["optimizer_state"] == 0
    return result


def _infinity_body(rank: int, world_size: int, *, root: str) -> dict:
    folder = Path(root) / f"run{rank}"
    cpu = _train(rank, world_size, "cpu", folder / "cpu", None)
    infinity = _train(rank, world_size, "nvme", folder / "infinity", None)
    assert infinity["losses"] == cpu["losses"], (infinity["losses"], cpu["losses"])
    events: list = []  # the optimizer state alone on NVMe, its swaps recorded
    recorded = _train(rank, world_size, "nvme", folder / "recorded", events)
    assert recorded["losses"] == cpu["losses"]
    return {"cpu": cpu, "infinity": infinity, "events": events}


def _check_overlap(events: list) -> None:
    """In the last step, sub-group i+1's read starts before sub-group i steps, and i is
    written back right after it (see [Note: ZeRO-Infinity sub-group pipeline])."""
    events = [(kind, list(groups)) for kind, groups in events]
    events = events[: events.index(("trained", []))]
    count = max(g for kind, groups in events if kind == "step" for g in groups) + 1
    expected = [("in", [0])]
    for i in range(count):
        if i + 1 < count:
            expected.append(("in", [i + 1]))
        expected += [("step", [i]), ("out", [i])]
    assert events[-len(expected) :] == expected, events[-len(expected) :]


def test_zero_infinity_trains_exactly_like_cpu_offload(tmp_path: Path) -> None:
    results = run_on_ranks(_infinity_body, 2, root=str(tmp_path), timeout=600)
    for result in results:
        infinity = result["infinity"]
        count = infinity["sub_groups"]
        assert count > 1
        assert infinity["writes"] == 2 * count * STEPS  # exp_avg, exp_avg_sq per sub-group
        assert infinity["files"] == sorted(
            f"group{i}_{name}.swp" for i in range(count) for name in ("exp_avg", "exp_avg_sq")
        )
        assert infinity["param_reads"] > 0  # max_in_cpu=0: shards come back from their files
        assert infinity["moments"] == ["exp_avg", "exp_avg_sq", "step"]
        host = infinity["host"]
        assert host["pinned_staging"] > 0 and host["optimizer_state"] == 0
        assert host["masters"] > 0 and host["param_shards"] < result["cpu"]["host"]["param_shards"]
        # CPU offload holds Adam's two moments in host memory, ZeRO-Infinity on NVMe.
        assert result["cpu"]["host"]["optimizer_state"] == 2 * host["masters"]
        _check_overlap(result["events"])


def _norm_body(rank: int, world_size: int) -> list[float]:
    import torch
    import torch.distributed as dist

    from ds_zero import ZeroConfig, build_zero_optimizer

    runs = []
    for stage in (2, 3):
        model = make_model(torch.float32)
        zero = build_zero_optimizer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            ZeroConfig.from_dict({"stage": stage, "reduce_bucket_size": 1500}),
            # as if a model-parallel peer in the world group held the same parameters and
            # counted the tied embedding itself
            norm_group=dist.group.WORLD,
            norm_exclude=[model.tok.weight],
            gradient_clipping=1e-2,
        )
        norms = []
        for batch in global_batches(2, ROWS):
            zero.backward(model(next(micro_batches(batch, rank, world_size, 1))))
            assert zero.step().applied
            norms.append(zero.get_global_grad_norm())
        if stage == 3:
            params = [p for _, p in model.named_parameters()]
            params[0].ds_partitioner.gather(params).wait()
        state = {n: p.detach().clone() for n, p in model.named_parameters()}
        runs.append((norms, state))
    (norms2, state2), (norms3, state3) = runs
    assert norms3 == pytest.approx(norms2, rel=1e-6)
    for name, value in state2.items():
        assert torch.allclose(state3[name], value, rtol=1e-5, atol=1e-7), name
    return norms3


def test_norm_group_and_exclude_at_stage_3_match_stage_2() -> None:
    norms = run_on_ranks(_norm_body, 2)
    assert norms[0] == norms[1]
