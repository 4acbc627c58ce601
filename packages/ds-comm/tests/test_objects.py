"""Object collectives on 1, 2 and 4 gloo ranks: every rank's object arrives whole, in group order.

Objects differ in size per rank (so the padding path is exercised) and include tensors, nested
containers and None. The tracker hook shows their bytes move through ds-comm's tracked tensor
collectives.
"""

from __future__ import annotations

import pytest
import torch

from ds_testing import run_on_ranks

WORLD_SIZES = [1, 2, 4]


def _obj(rank: int, salt: int = 0) -> dict:
    """A picklable object whose size depends on the rank."""
    return {
        "rank": rank,
        "salt": salt,
        "text": "x" * (rank * 37 + salt),
        "tensor": torch.arange(rank + 1, dtype=torch.float32) * (salt + 1),
        "nested": [None, (rank, {"k": [rank] * rank})],
    }


def _same(a: dict, b: dict) -> bool:
    return (
        a.keys() == b.keys()
        and all(a[k] == b[k] for k in ("rank", "salt", "text", "nested"))
        and torch.equal(a["tensor"], b["tensor"])
    )


def _body(rank: int, world_size: int) -> list[str]:
    import ds_comm
    from ds_comm import _instrument

    ops: list[str] = []
    hook = lambda rec: ops.append(rec.fingerprint.op)  # noqa: E731
    _instrument.TRACKER.on_end.append(hook)
    try:
        everyone = [None] * world_size
        ds_comm.all_gather_object(everyone, _obj(rank))
        assert all(_same(everyone[r], _obj(r)) for r in range(world_size)), everyone

        for src in range(world_size):
            objs = [_obj(src, 1), "second", None] if rank == src else [None, None, None]
            ds_comm.broadcast_object_list(objs, src=src)
            assert _same(objs[0], _obj(src, 1)) and objs[1:] == ["second", None], (src, objs)

        for dst in range(world_size):
            gathered = [None] * world_size if rank == dst else None
            ds_comm.gather_object(_obj(rank, 2), gathered, dst=dst)
            if rank == dst:
                assert all(_same(gathered[r], _obj(r, 2)) for r in range(world_size))

        for src in range(world_size):
            out = [None]
            sent = [_obj(r, 3) for r in range(world_size)] if rank == src else None
            ds_comm.scatter_object_list(out, sent, src=src)
            assert _same(out[0], _obj(rank, 3)), (src, out)
    finally:
        _instrument.TRACKER.on_end.remove(hook)
    return ops


def _subgroup_body(rank: int, world_size: int) -> list:
    import ds_comm

    group = ds_comm.new_group([0, 2])
    seen = [None, None]
    ds_comm.all_gather_object(seen, f"from {rank}", group=group)
    box = [f"src {rank}"]
    ds_comm.broadcast_object_list(box, src=2, group=group)
    return [seen, box]


def _errors_body(rank: int, world_size: int) -> list[str]:
    import ds_comm

    errors = []
    for call in (
        lambda: ds_comm.all_gather_object([None] * (world_size + 1), 1),
        lambda: ds_comm.broadcast_object_list([1], src=world_size),
        lambda: ds_comm.gather_object(1, None, dst=rank),
        lambda: ds_comm.scatter_object_list([], [1] * world_size, src=rank),
    ):
        try:
            call()
        except ValueError as exc:
            errors.append(str(exc))
    return errors


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_object_collectives(world_size: int) -> None:
    n = world_size
    for ops in run_on_ranks(_body, world_size):
        # sizes then payload for each call: all_gather x2; broadcast x2 per src; gather: sizes
        # all-gathered, payload gathered; scatter: sizes broadcast, payload scattered
        expected = ["all_gather_into_tensor"] * 2
        expected += ["broadcast", "broadcast"] * n
        expected += ["all_gather_into_tensor", "gather"] * n
        expected += ["broadcast", "scatter"] * n
        assert ops == expected


def test_object_collectives_on_a_subgroup() -> None:
    results = run_on_ranks(_subgroup_body, 4)
    for rank in (0, 2):
        assert results[rank] == [["from 0", "from 2"], ["src 2"]]
    for rank in (1, 3):
        assert results[rank] == [[None, None], [f"src {rank}"]]  # not members: untouched


@pytest.mark.parametrize("world_size", [1, 2])
def test_object_collective_errors(world_size: int) -> None:
    for errors in run_on_ranks(_errors_body, world_size):
        assert len(errors) == 4, errors
        assert f"object_list has {world_size + 1} entries, group has {world_size}" in errors[0]
        assert "is not in the group" in errors[1]
        assert f"object_gather_list needs {world_size} entries, got None" in errors[2]
        assert "must be a non-empty list" in errors[3]


@pytest.mark.gpu(1)
def test_object_collectives_on_nccl() -> None:
    # the object bytes must travel on the accelerator's current device for an NCCL group
    ops = run_on_ranks(_body, 1, backend="nccl", fresh=True)[0]
    assert ops[:2] == ["all_gather_into_tensor"] * 2 and ops[-2:] == ["broadcast", "scatter"]


def _debug_body(rank: int, world_size: int) -> list[str]:
    """The same calls with the debug fingerprint check on: the ranks agree, so none is raised."""
    import ds_comm

    previous = ds_comm.configure(debug=True)
    try:
        return _body(rank, world_size)
    finally:
        ds_comm.configure(previous)


@pytest.mark.parametrize("world_size", [2, 4])
def test_object_collectives_pass_the_debug_check(world_size: int) -> None:
    # payloads are padded to one size, so per-rank object sizes do not look like a mismatch
    results = run_on_ranks(_debug_body, world_size)
    assert results == [results[0]] * world_size and len(results[0]) == 2 + 6 * world_size
