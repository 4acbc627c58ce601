"""Ulysses ``DistributedAttention`` (``deepspeed.sequence.layer``): SP=N equals SP=1 attention
on the whole sequence, outputs and input gradients, on real gloo ranks."""

from __future__ import annotations

import pytest

from ds_testing import run_on_ranks


class _SDPA:
    """Local attention: torch SDPA on ``[s, b, h, d]`` (seq_dim 0) or ``[b, s, h, d]`` (1)."""

    def __init__(self, seq_dim: int, causal: bool) -> None:
        self.seq_dim, self.causal = seq_dim, causal

    def _bhsd(self, x):  # -> [b, h, s, d]
        return x.permute(1, 2, 0, 3) if self.seq_dim == 0 else x.transpose(1, 2)

    def __call__(self, q, k, v):
        import torch.nn.functional as F

        q, k, v = (self._bhsd(x) for x in (q, k, v))
        groups = q.shape[1] // k.shape[1]  # grouped-query attention: kv heads serve groups
        k, v = (x.repeat_interleave(groups, dim=1) for x in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return out.permute(2, 0, 1, 3) if self.seq_dim == 0 else out.transpose(1, 2)


def _case_error(group, *, seq_dim: int, causal: bool, heads: int, kv_heads: int) -> float:
    """Max |SP - reference| over the output and the q/k/v gradients of this rank's slice."""
    import torch

    import ds_comm
    from ds_engine.sequence.layer import DistributedAttention

    size, me = ds_comm.get_world_size(group), ds_comm.get_rank(group)
    seq, batch, dim = 4 * size, 2, 8
    gen = torch.Generator().manual_seed(1234 + heads + kv_heads + seq_dim + int(causal))

    def full(h):  # [s, b, h, d] or [b, s, h, d]
        shape = (seq, batch, h, dim) if seq_dim == 0 else (batch, seq, h, dim)
        return torch.randn(shape, generator=gen, dtype=torch.float64)

    q, k, v = full(heads), full(kv_heads), full(kv_heads)
    grad_out = full(heads)
    attention = _SDPA(seq_dim, causal)

    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out = attention(*ref_in)
    ref_out.backward(grad_out)

    rows = seq // size

    def mine(x):
        return x.narrow(seq_dim, me * rows, rows)

    sp_in = [mine(x).clone().requires_grad_() for x in (q, k, v)]
    layer = DistributedAttention(attention, group, scatter_idx=2, gather_idx=seq_dim)
    out = layer(*sp_in, 1 - seq_dim)
    assert out.shape == mine(ref_out).shape
    out.backward(mine(grad_out))
    errors = [(out - mine(ref_out)).abs().max()]
    for a, b in zip(sp_in, ref_in):
        assert a.grad is not None and b.grad is not None
        errors.append((a.grad - mine(b.grad)).abs().max())
    return max(float(e) for e in errors)


def _parity_body(rank: int, world_size: int) -> dict[str, float]:
    import ds_comm

    groups = {f"sp{world_size}": None}
    if world_size == 4:  # two sequence groups of 2 ranks, as next to data parallelism
        pairs = [ds_comm.new_group([0, 1]), ds_comm.new_group([2, 3])]
        groups["sp2x2"] = pairs[rank // 2]
    results = {}
    for label, group in groups.items():
        size = ds_comm.get_world_size(group)
        for seq_dim in (0, 1):
            for causal in (False, True):
                for heads, kv_heads in ((2 * size, 2 * size), (2 * size, size)):
                    key = f"{label} seq_dim={seq_dim} causal={causal} heads={heads}/{kv_heads}"
                    results[key] = _case_error(
                        group, seq_dim=seq_dim, causal=causal, heads=heads, kv_heads=kv_heads
                    )
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_ulysses_matches_full_sequence_attention(world_size: int) -> None:
    for per_rank in run_on_ranks(_parity_body, world_size, timeout=120):
        assert per_rank
        for case, error in per_rank.items():
            assert error < 1e-10, (case, error)


def _bad_heads_body(rank: int, world_size: int) -> list[str]:
    import torch

    from ds_engine.sequence.layer import DistributedAttention

    messages = []
    layer = DistributedAttention(_SDPA(0, False), None)
    x = torch.randn(2, 1, 3, 4)
    for kwargs in ({}, {"num_kv_heads": 3}):
        layer.num_kv_heads = kwargs.get("num_kv_heads")
        try:
            layer(x, x, x, 1)
        except ValueError as err:
            messages.append(str(err))
    q = torch.randn(2, 1, 3, 4)  # query heads indivisible, kv heads fine
    kv = torch.randn(2, 1, 2, 4)
    layer.num_kv_heads = None
    try:
        layer(q, kv, kv, 1)
    except ValueError as err:
        messages.append(str(err))
    return messages


def test_indivisible_heads_name_both_numbers() -> None:
    for messages in run_on_ranks(_bad_heads_body, 2, timeout=60):
        assert len(messages) == 3
        for message in messages:
            assert "(3)" in message and "(2)" in message and "divisible" in message


def test_refused_arguments_say_so() -> None:
    import torch

    from ds_engine.sequence.layer import DistributedAttention

    with pytest.raises(NotImplementedError, match="sp_stream"):
        DistributedAttention(_SDPA(0, False), None, sp_stream=object())
    with pytest.raises(ValueError, match="scatter_idx=1"):
        DistributedAttention(_SDPA(0, False), None, scatter_idx=1)
    with pytest.raises(ValueError, match="gather_idx=2"):
        DistributedAttention(_SDPA(0, False), None, gather_idx=2)
    layer = DistributedAttention(_SDPA(0, False), None)
    x = torch.randn(2, 1, 2, 4)
    with pytest.raises(NotImplementedError, match="rotary_pos_emb"):
        layer(x, x, x, 1, (x, x))
    with pytest.raises(ValueError, match="batch_dim_idx=2"):
        layer(x, x, x, 2)


def test_deepspeed_module_path() -> None:
    import ds_engine
    from ds_engine.sequence import layer

    assert ds_engine.sequence.layer is layer
    assert ds_engine.sequence.DistributedAttention is layer.DistributedAttention
