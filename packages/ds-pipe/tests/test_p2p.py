"""Activation/gradient transfers between stages: negotiated headers, dtypes, tuples, errors."""

from __future__ import annotations

import pytest
import torch

from ds_pipe._p2p import PipeChannels, as_tensor_tuple
from ds_testing import run_on_ranks


def _channels(world_size: int) -> PipeChannels:
    """Channels of a 2-stage pipeline with two chunks per stage (chunks 0, 2 on rank 0)."""
    group = torch.distributed.new_group(ranks=list(range(world_size)))
    return PipeChannels(group, lambda chunk: chunk % world_size, torch.device("cpu"))


def _values(mb: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(mb)
    return (
        torch.randn(3, 4, generator=gen).requires_grad_(True),
        torch.randint(0, 100, (5,), generator=gen),  # int64 token ids, no grad
        torch.rand(2, 2, generator=gen) > 0.5,  # a bool mask
        torch.randn(2, 3, generator=gen).to(torch.bfloat16).requires_grad_(True),
    )


def _roundtrip_body(rank: int, world_size: int) -> list[int]:
    ch = _channels(world_size)
    sends_per_mb = []
    for mb in range(3):
        if rank == 0:
            value = _values(mb)
            before = sum(len(v) for v in ch._pending.values())
            ch.send_activation(value, 0, "train", "stage 0")
            ch.send_activation(value[0] * 2, 2, "train", "stage 0, chunk 2")  # to chunk 3
            sends_per_mb.append(sum(len(v) for v in ch._pending.values()) - before)
            grads = ch.recv_grads(value, 0)
            assert grads[1] is None and grads[2] is None  # no grad for ints and bools
            torch.testing.assert_close(grads[0], torch.full((3, 4), 3.0))
            torch.testing.assert_close(grads[3], torch.ones(2, 3, dtype=torch.bfloat16))
            ch.wait_sends()
        else:
            got = ch.recv_activation(1, "train")
            single = ch.recv_activation(3, "train")
            assert isinstance(got, tuple) and torch.is_tensor(single)
            for a, b in zip(got, _values(mb)):
                assert a.dtype == b.dtype and a.requires_grad == b.requires_grad
                torch.testing.assert_close(a, b.detach())
            torch.testing.assert_close(single, _values(mb)[0].detach() * 2)
            ((got[0] * 3).sum() + got[3].float().sum()).backward()
            ch.send_grads(got, 1)
            ch.wait_sends()
    return sends_per_mb


def test_tensors_tuples_and_dtypes_roundtrip_with_one_header() -> None:
    sends = run_on_ranks(_roundtrip_body, 2)[0]
    # first micro-batch: length + header + 4 tensors, and length + header + 1 tensor
    assert sends == [2 + 4 + 2 + 1, 4 + 1, 4 + 1]


def _shape_change_body(rank: int, world_size: int) -> str:
    ch = _channels(world_size)
    if rank == 1:
        ch.recv_activation(1, "train")
        return ""
    ch.send_activation(torch.zeros(2, 3), 0, "train", "stage 0, micro-batch 0")
    try:
        ch.send_activation(torch.zeros(4, 3), 0, "train", "stage 0, micro-batch 1")
    except ValueError as exc:
        return str(exc)
    finally:
        ch.wait_sends()
    return "no error"


def test_changed_shape_is_an_error_naming_both_shapes() -> None:
    message = run_on_ranks(_shape_change_body, 2)[0]
    assert "stage 0, micro-batch 1" in message
    assert "torch.float32[2, 3]" in message and "torch.float32[4, 3]" in message


def test_non_tensor_output_names_the_stage() -> None:
    with pytest.raises(TypeError, match=r"stage 1 .*item 1 of the output is a dict"):
        as_tensor_tuple((torch.zeros(1), {"a": 1}), "stage 1 (layers 3-5)")
    with pytest.raises(TypeError, match="the output is a str"):
        as_tensor_tuple("x", "stage 0")
    assert len(as_tensor_tuple([torch.zeros(1), torch.ones(1)], "")) == 2


def _posting_body(rank: int, world_size: int) -> list[list[int]]:
    """Two batches of 3 micro-batches over chunk 0 (rank 0) -> chunk 1 (rank 1). Returns, per
    batch on rank 0, the gradient receives posted after ``start_batch`` and after each send."""
    ch = PipeChannels(
        torch.distributed.new_group(ranks=[0, 1]), lambda chunk: chunk, torch.device("cpu")
    )
    posted: list[list[int]] = []
    for batch in range(2):
        if rank == 0:
            ch.start_batch("train", {1: [("grad", 0)] * 3})
            counts = [len(ch._posted.get(("grad", 0), ()))]
            for mb in range(3):
                ch.send_activation(
                    torch.full((2, 3), float(mb), requires_grad=True), 0, "train", ""
                )
                counts.append(len(ch._posted.get(("grad", 0), ())))
            for mb in range(3):
                (grad,) = ch.recv_grads((torch.zeros(2, 3, requires_grad=True),), 0)
                torch.testing.assert_close(grad, torch.full((2, 3), 10.0 * batch + mb))
            posted.append(counts)
        else:
            ch.start_batch("train", {0: [("act", 1)] * 3})
            for mb in range(3):
                x = ch.recv_activation(1, "train")
                torch.testing.assert_close(x, torch.full((2, 3), float(mb)))
                x.grad = torch.full((2, 3), 10.0 * batch + mb)
                ch.send_grads((x,), 1)
        ch.wait_sends()
    return posted


def test_gradient_receives_are_posted_by_the_first_send_not_before() -> None:
    posted = run_on_ranks(_posting_body, 2)[0]
    # nothing is posted ahead of the first forward, even in batch 1 whose metadata is known at
    # start_batch; each send tops the channel up to two posted receives
    assert posted == [[0, 2, 2, 2], [0, 2, 2, 2]]


def _out_of_order_body(rank: int, world_size: int, *, tagless: bool) -> list[str]:
    """Rank 0 sends chunk 0's and chunk 2's outputs (to chunks 1 and 3 on rank 1) in that order;
    rank 1 takes them the other way round. With every tag equal, only posting the receives in
    the sender's order (declared by ``start_batch``) pairs them right."""
    ch = PipeChannels(
        torch.distributed.new_group(ranks=[0, 1]),
        lambda chunk: chunk % 2,
        torch.device("cpu"),
        tagless=tagless,
    )
    assert ch.tagless == tagless
    seen = []
    for batch in range(2):  # the first negotiates headers, the second sends data only
        if rank == 0:
            ch.start_batch("eval", {})
            for mb in range(3):
                ch.send_activation(torch.full((2, 3), float(mb)), 0, "eval", "chunk 0")
                ch.send_activation(torch.full((5,), 10.0 + mb, dtype=torch.float64), 2, "eval", "")
            ch.wait_sends()
        else:
            ch.start_batch("eval", {0: [("act", 1), ("act", 3)] * 3})
            for mb in range(3):
                late = ch.recv_activation(3, "eval")  # sent second, taken first
                early = ch.recv_activation(1, "eval")
                torch.testing.assert_close(late, torch.full((5,), 10.0 + mb, dtype=torch.float64))
                torch.testing.assert_close(early, torch.full((2, 3), float(mb)))
                seen.append(f"{batch}:{mb}")
    return seen


@pytest.mark.parametrize("tagless", [False, True], ids=["tags", "tagless"])
def test_receives_follow_the_senders_order_whatever_the_takers_order(tagless: bool) -> None:
    assert run_on_ranks(_out_of_order_body, 2, tagless=tagless)[1] == [
        f"{b}:{mb}" for b in range(2) for mb in range(3)
    ]


def _mode_body(rank: int, world_size: int) -> list[bool]:
    from ds_pipe._p2p import resolve_tagless

    group = torch.distributed.new_group(ranks=[0])
    return [resolve_tagless(group), resolve_tagless(group, tagless=True)]


def test_tagless_mode_is_chosen_by_backend_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from ds_pipe._p2p import resolve_tagless

    assert run_on_ranks(_mode_body, 1) == [[False, True]]  # gloo honours tags
    assert run_on_ranks(_mode_body, 1, env={"DS_PIPE_TAGLESS": "1"}) == [[True, True]]
    monkeypatch.setenv("DS_PIPE_TAGLESS", "maybe")
    with pytest.raises(ValueError, match=r"DS_PIPE_TAGLESS='maybe': expected 1"):
        resolve_tagless(None)
