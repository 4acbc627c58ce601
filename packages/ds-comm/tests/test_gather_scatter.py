"""gather, scatter, all_to_all (list form) and monitored_barrier on 1, 2 and 4 gloo ranks.

Each body builds every rank's input in-rank (``_block(r)``: integer values that depend on the
rank, exact in every dtype) and compares with the single-process answer. The records handed to
the tracker's ``on_end`` hook show that each op takes ds-comm's tracked path with nccl-tests
message sizes.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch

from ds_testing import run_on_ranks

WORLD_SIZES = [1, 2, 4]
DTYPES = ["float32", "bfloat16", "int64"]


def _block(rank: int, numel: int, dtype: str, salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s block: ``10 * rank + salt + [0, 1, 2, ...]`` (exact in bf16 up to 256)."""
    base = torch.arange(numel) + 10 * rank + salt
    return base.to(getattr(torch, dtype))


def _finish(handle: object, async_op: bool) -> None:
    if async_op:
        assert handle is not None and hasattr(handle, "wait")
        handle.wait()
    else:
        assert handle is None


def _gather_scatter_body(rank: int, world_size: int) -> int:
    import ds_comm

    checks = 0
    for salt, (dtype, async_op) in enumerate(itertools.product(DTYPES, (False, True))):
        for root in range(world_size):
            mine = _block(rank, 5, dtype, salt)
            outs = [torch.full((5,), -1, dtype=mine.dtype) for _ in range(world_size)]
            handle = ds_comm.gather(
                mine, outs if rank == root else None, dst=root, async_op=async_op
            )
            _finish(handle, async_op)
            if rank == root:
                for r, out in enumerate(outs):
                    assert torch.equal(out, _block(r, 5, dtype, salt)), (dtype, root, r, out)
            else:
                assert all((o == -1).all() for o in outs)  # non-roots' lists are untouched
            parts = [_block(r, 3, dtype, salt + 1) for r in range(world_size)]
            got = torch.full((3,), -1, dtype=mine.dtype)
            handle = ds_comm.scatter(
                got, parts if rank == root else None, src=root, async_op=async_op
            )
            _finish(handle, async_op)
            assert torch.equal(got, _block(rank, 3, dtype, salt + 1)), (dtype, root, got)
            checks += 2
    return checks


def _all_to_all_body(rank: int, world_size: int) -> int:
    import ds_comm
    from ds_comm._collectives import force_algorithm

    def run(outputs: list, inputs: list, algo: str | None, async_op: bool) -> None:
        forced = force_algorithm(all_to_all=algo) if algo else contextlib.nullcontext()
        with forced:
            _finish(ds_comm.all_to_all(outputs, inputs, async_op=async_op), async_op)

    checks = 0
    for salt, (dtype, async_op) in enumerate(itertools.product(DTYPES, (False, True))):
        # equal blocks: rank r sends [10r + salt + p, ...] to rank p
        for algo in ("native", "direct", None):
            inputs = [_block(rank, 3, dtype, salt + p) for p in range(world_size)]
            outputs = [torch.full((3,), -1, dtype=inputs[0].dtype) for _ in range(world_size)]
            run(outputs, inputs, algo, async_op)
            for src, out in enumerate(outputs):
                assert torch.equal(out, _block(src, 3, dtype, salt + rank)), (algo, src, out)
            checks += 1
        # uneven blocks (gloo's own refuses them; the default picks point-to-point)
        for algo in ("direct", None):
            inputs = [_block(rank, p + 1, dtype, salt + p) for p in range(world_size)]
            outputs = [torch.full((rank + 1,), -1, dtype=inputs[0].dtype) for _ in inputs]
            run(outputs, inputs, algo, async_op)
            for src, out in enumerate(outputs):
                assert torch.equal(out, _block(src, rank + 1, dtype, salt + rank)), (algo, src)
            checks += 1
    # strided outputs (every other element of a buffer) are filled in place, gaps untouched
    for algo in ("direct", None):
        buf = torch.full((world_size, 4), -1, dtype=torch.int64)
        strided = [buf[p, ::2] for p in range(world_size)]
        sent = [torch.tensor([100 * rank + p, 50]) for p in range(world_size)]
        run(strided, sent, algo, False)
        assert buf[:, 0].tolist() == [100 * p + rank for p in range(world_size)], algo
        assert (buf[:, 2] == 50).all() and (buf[:, 1::2] == -1).all(), algo
        checks += 1
    return checks


def _subgroup_body(rank: int, world_size: int) -> list[int]:
    """Ranks 1 and 3 form a group; dst/src are global ranks; non-members get None back."""
    import ds_comm

    group = ds_comm.new_group([1, 3])
    mine = torch.tensor([rank * 7])
    outs = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
    handle = ds_comm.gather(mine, outs if rank == 3 else None, dst=3, group=group)
    assert handle is None
    got = torch.zeros(1, dtype=torch.int64)
    parts = [torch.tensor([11]), torch.tensor([33])] if rank == 1 else None
    ds_comm.scatter(got, parts, src=1, group=group)
    ds_comm.monitored_barrier(group=group)
    if rank in (1, 3):
        assert got.item() == {1: 11, 3: 33}[rank]
    return [int(o.item()) for o in outs] if rank == 3 else [int(got.item())]


def _errors_body(rank: int, world_size: int) -> list[str]:
    import ds_comm

    errors = []
    t = torch.zeros(2)
    for call in (
        lambda: ds_comm.gather(t, [t] * world_size, dst=world_size),  # not a rank of the group
        lambda: ds_comm.gather(t, [t] * (world_size + 1), dst=rank),  # wrong list on the root
        lambda: ds_comm.scatter(t, None, src=rank),  # root without a list
        lambda: ds_comm.all_to_all([t], [t, t, t, t, t]),  # list lengths
    ):
        try:
            call()
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def _records_body(rank: int, world_size: int) -> list[tuple[str, int, str]]:
    import ds_comm
    from ds_comm import _instrument

    seen: list[tuple[str, int, str]] = []
    hook = lambda rec: seen.append((rec.fingerprint.op, rec.msg_bytes, rec.algo))  # noqa: E731
    _instrument.TRACKER.on_end.append(hook)
    try:
        block = torch.zeros(4)  # 16 bytes
        outs = [torch.zeros(4) for _ in range(world_size)]
        ds_comm.gather(block, outs if rank == 0 else None, dst=0)
        ds_comm.scatter(block, outs if rank == 0 else None, src=0)
        ds_comm.all_to_all([torch.zeros(4) for _ in outs], outs)
        ds_comm.monitored_barrier()
    finally:
        _instrument.TRACKER.on_end.remove(hook)
    return seen


def _debug_body(rank: int, world_size: int) -> list[int]:
    """gather/scatter/all_to_all with the debug fingerprint check on (per-rank lists differ)."""
    import ds_comm

    previous = ds_comm.configure(debug=True)
    try:
        return [_gather_scatter_body(rank, world_size), _all_to_all_body(rank, world_size)]
    finally:
        ds_comm.configure(previous)


@pytest.mark.parametrize("world_size", [2, 4])
def test_debug_check_accepts_rooted_and_uneven_ops(world_size: int) -> None:
    assert run_on_ranks(_debug_body, world_size) == [[12 * world_size, 32]] * world_size


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_gather_and_scatter(world_size: int) -> None:
    assert run_on_ranks(_gather_scatter_body, world_size) == [12 * world_size] * world_size


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_to_all_list_form(world_size: int) -> None:
    assert run_on_ranks(_all_to_all_body, world_size) == [32] * world_size


def test_subgroup_roots_are_global_ranks() -> None:
    results = run_on_ranks(_subgroup_body, 4)
    assert results[3] == [7, 21]  # gathered from global ranks 1 and 3, in group order
    assert results[1] == [11]
    assert results[0] == results[2] == [0]  # not members: nothing happened


@pytest.mark.parametrize("world_size", [1, 2])
def test_bad_arguments_are_clear_errors(world_size: int) -> None:
    for errors in run_on_ranks(_errors_body, world_size):
        assert len(errors) == 4, errors
        assert "is not in the group" in errors[0]
        assert f"needs {world_size} tensors, got {world_size + 1} tensors" in errors[1]
        assert "got None" in errors[2]
        assert "all_to_all: output_tensor_list has 1 tensors" in errors[3] or world_size == 1


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_records_carry_op_names_and_sizes(world_size: int) -> None:
    n = world_size
    expected = [
        ("gather", 16 * n, "native"),  # the whole gathered buffer
        ("scatter", 16 * n, "native"),
        ("all_to_all", 16 * n, "native"),  # bytes this rank sends
        ("monitored_barrier", 0, "native"),
    ]
    assert run_on_ranks(_records_body, world_size) == [expected] * world_size


def _nccl_body(rank: int, world_size: int) -> int:
    import ds_comm
    from ds_comm.accelerator import get_accelerator

    device = get_accelerator().current_device_name()
    block = torch.arange(4, device=device, dtype=torch.float32)
    outs = [torch.empty(4, device=device)]
    ds_comm.gather(block, outs, dst=0)
    got = torch.empty(4, device=device)
    ds_comm.scatter(got, [block * 2], src=0)
    result = [torch.empty(4, device=device)]
    ds_comm.all_to_all(result, [block + 1])
    assert torch.equal(outs[0], block) and torch.equal(got, block * 2)
    assert torch.equal(result[0], block + 1)
    return 3


@pytest.mark.gpu(1)
def test_rooted_ops_on_nccl() -> None:
    assert run_on_ranks(_nccl_body, 1, backend="nccl", fresh=True) == [3]
