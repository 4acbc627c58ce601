"""Schedules as plain instruction lists: coverage, matching transfers, buffers, no deadlock."""

from __future__ import annotations

from collections import deque

import pytest

from ds_pipe._schedule import (
    BackwardPass,
    ForwardPass,
    GPipeSchedule,
    InferenceSchedule,
    InterleavedSchedule,
    LoadMicroBatch,
    OptimizerStep,
    PipeSchedule,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
    TrainSchedule,
    build_schedule,
)


def _schedules(kind: str, m: int, p: int, v: int = 1) -> list[PipeSchedule]:
    if kind == "inference":
        return [InferenceSchedule(m, p, s, v) for s in range(p)]
    return [
        build_schedule(kind, micro_batches=m, stages=p, stage_id=s, virtual_stages=v)
        for s in range(p)
    ]


def simulate(schedules: list[PipeSchedule]) -> list[tuple[int, object]]:
    """Run every stage's list as the engine does: sends never block, receives block until the
    matching send (same channel, in order) was posted. Returns the global execution order and
    fails on a deadlock or a mismatched message."""
    p = len(schedules)
    n = schedules[0].num_chunks
    programs = [deque(s.instructions()) for s in schedules]
    channels: dict[tuple[str, int], deque[int]] = {}
    order: list[tuple[int, object]] = []
    while any(programs):
        progressed = False
        for stage, program in enumerate(programs):
            while program:
                cmd = program[0]
                if isinstance(cmd, (RecvActivation, RecvGrad)):
                    kind = "act" if isinstance(cmd, RecvActivation) else "grad"
                    queue = channels.get((kind, cmd.chunk_id))
                    if not queue:
                        break
                    assert queue.popleft() == cmd.micro_batch_id, (stage, cmd)
                elif isinstance(cmd, SendActivation):
                    assert cmd.chunk_id + 1 < n
                    assert (cmd.chunk_id + 1) % p == (stage + 1) % p
                    channels.setdefault(("act", cmd.chunk_id + 1), deque()).append(
                        cmd.micro_batch_id
                    )
                elif isinstance(cmd, SendGrad):
                    assert cmd.chunk_id >= 1
                    channels.setdefault(("grad", cmd.chunk_id - 1), deque()).append(
                        cmd.micro_batch_id
                    )
                order.append((stage, program.popleft()))
                progressed = True
        assert progressed, f"deadlock: stages wait on {[list(pr)[:1] for pr in programs]}"
    assert all(not q for q in channels.values()), f"unreceived messages: {channels}"
    return order


CASES = [
    ("1f1b", 1, 1, 1),
    ("1f1b", 4, 2, 1),
    ("1f1b", 8, 4, 1),
    ("1f1b", 2, 4, 1),
    ("gpipe", 4, 2, 1),
    ("gpipe", 3, 4, 1),
    ("interleaved", 4, 2, 2),
    ("interleaved", 8, 4, 2),
    ("interleaved", 4, 4, 3),
    ("interleaved", 3, 1, 2),
]


@pytest.mark.parametrize(("kind", "m", "p", "v"), CASES)
def test_each_micro_batch_forward_and_backward_once(kind: str, m: int, p: int, v: int) -> None:
    for sched in _schedules(kind, m, p, v):
        cmds = sched.instructions()
        for cls in (ForwardPass, BackwardPass):
            seen = sorted((c.micro_batch_id, c.chunk_id) for c in cmds if isinstance(c, cls))
            assert seen == sorted((mb, c) for mb in range(m) for c in sched.chunk_ids())
        # a backward never precedes its forward
        done = set()
        for c in cmds:
            if isinstance(c, ForwardPass):
                done.add((c.micro_batch_id, c.chunk_id))
            if isinstance(c, BackwardPass):
                assert (c.micro_batch_id, c.chunk_id) in done
        # the batch ends with the gradient step, exactly once
        tail = [type(c) for c in cmds if not hasattr(c, "micro_batch_id")]
        assert tail == [ReduceTiedGrads, ReduceGrads, OptimizerStep]
        assert type(cmds[-1]) is OptimizerStep


@pytest.mark.parametrize(("kind", "m", "p", "v"), [*CASES, *[("inference", 5, 3, 1)]])
def test_sends_match_receives_without_deadlock(kind: str, m: int, p: int, v: int) -> None:
    order = simulate(_schedules(kind, m, p, v))
    n = p * v
    loads = [(s, c) for s, c in order if isinstance(c, LoadMicroBatch)]
    # loads happen on the first and last virtual stage only, once per micro-batch each
    assert sorted(c.micro_batch_id for _, c in loads) == sorted(
        [mb for mb in range(m)] * (1 if n == 1 else 2)
    )
    assert all(c.chunk_id in (0, n - 1) for _, c in loads)


@pytest.mark.parametrize(("m", "p"), [(8, 4), (2, 4), (16, 2), (5, 3)])
def test_1f1b_live_buffers_at_most_num_stages(m: int, p: int) -> None:
    for s, sched in enumerate(_schedules("1f1b", m, p)):
        assert sched.num_pipe_buffers() == min(p - s, m) <= p
    assert max(s.num_pipe_buffers() for s in _schedules("gpipe", m, p)) == m


def test_1f1b_order_on_a_middle_stage() -> None:
    sched = TrainSchedule(micro_batches=4, stages=3, stage_id=1)
    kinds = [
        ("F" if isinstance(c, ForwardPass) else "B", c.micro_batch_id)
        for c in sched.instructions()
        if isinstance(c, (ForwardPass, BackwardPass))
    ]
    assert kinds == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]
    first = next(iter(sched))
    assert first == [RecvActivation(0, 1), ForwardPass(0, 1), SendActivation(0, 1)]
    assert str(first[1]) == "ForwardPass(mb=0, chunk=1)"
    assert "step   0: RecvActivation(mb=0, chunk=1)" in str(sched)


def test_gpipe_and_interleaved_shapes() -> None:
    g = GPipeSchedule(micro_batches=3, stages=2, stage_id=1)
    passes = [c for c in g.instructions() if isinstance(c, (ForwardPass, BackwardPass))]
    assert [type(c) for c in passes] == [ForwardPass] * 3 + [BackwardPass] * 3
    il = InterleavedSchedule(micro_batches=4, stages=2, stage_id=0, virtual_stages=2)
    assert il.chunk_ids() == [0, 2]
    forwards = [(c.micro_batch_id, c.chunk_id) for c in il.instructions() if type(c) is ForwardPass]
    assert forwards[:4] == [(0, 0), (1, 0), (0, 2), (1, 2)]
    assert any(isinstance(c, SendGrad) and c.chunk_id == 2 for c in il.instructions())


def test_bad_arguments_name_the_value() -> None:
    with pytest.raises(ValueError, match="micro_batches = 0"):
        TrainSchedule(0, 2, 0)
    with pytest.raises(ValueError, match="stage_id = 2"):
        TrainSchedule(4, 2, 2)
    with pytest.raises(ValueError, match="multiple of the 2 stages"):
        InterleavedSchedule(3, 2, 0, 2)
    with pytest.raises(ValueError, match="schedule = 'zigzag'"):
        build_schedule("zigzag", micro_batches=2, stages=2, stage_id=0)
    with pytest.raises(ValueError, match="only schedule='interleaved'"):
        build_schedule("1f1b", micro_batches=2, stages=2, stage_id=0, virtual_stages=2)
