"""Expert parallelism on real gloo ranks against a single-process reference holding all experts.

Every rank builds the same reference model (``ep_size=1``, all experts, distinct random weights)
and the expert-parallel model holding its share of them. Data-parallel rank ``r`` feeds its own
tokens to the expert-parallel model (tensor-parallel peers, with an mpu, share them); the
reference runs every data-parallel rank's tokens, one batch at a time (the capacity is per batch,
as on each rank), with the same routing seed per batch. Outputs, ``l_aux``
and ``exp_counts`` must match on every rank; after ``all_reduce_gradients`` every gradient must
match the reference's gradient of the mean loss over all ranks' batches.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ds_testing import run_on_ranks

HIDDEN = 8
NUM_EXPERTS = 4
BATCH = (3, 5)  # 15 tokens per rank: capacities are uneven, some tokens drop


def _reference(k: int, seed: int = 1, **moe_kwargs: object) -> nn.Module:
    import ds_moe

    expert = nn.Sequential(nn.Linear(HIDDEN, 16), nn.ReLU(), nn.Linear(16, HIDDEN))
    model = ds_moe.MoE(HIDDEN, expert, num_experts=NUM_EXPERTS, k=k, **moe_kwargs)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # deep copies start equal: make every expert distinct
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(*BATCH, HIDDEN, generator=gen), torch.randn(*BATCH, HIDDEN, generator=gen)


def _loss(moe: nn.Module, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, target = _batch(rank)
    torch.manual_seed(1000 + rank)  # the routing seed of this batch (RTS, Gumbel, jitter)
    out, l_aux, counts = moe(x)
    return (out * target).sum() + 0.5 * l_aux, out, counts


def _tensor_parallel_mpu(world_size: int, tp: int):
    """ds-comm's mpu over (data, model): tensor-parallel peers see the same (replicated) tokens."""
    import ds_comm

    topology = ds_comm.PipeModelDataParallelTopology(num_pp=1, num_mp=tp, num_dp=world_size // tp)
    return ds_comm.Mpu(ds_comm.ProcessGrid(topology))


def _parity_body(
    rank: int, world_size: int, *, ep_size: int, k: int, moe_kwargs: dict, tp: int
) -> list:
    import ds_moe

    mpu = _tensor_parallel_mpu(world_size, tp) if tp > 1 else None
    dp_rank = rank if mpu is None else mpu.get_data_parallel_rank()
    dp_size = world_size // tp
    reference = _reference(k, **moe_kwargs)
    expected = []
    total = torch.zeros(())
    for r in range(dp_size):
        loss, out, counts = _loss(reference, r)
        expected.append((out.detach(), reference.deepspeed_moe.l_aux.detach(), counts))
        total = total + loss / dp_size
    total.backward()

    # A different init: every weight must come from the reference.
    model = _reference(k, seed=7, ep_size=ep_size, **moe_kwargs)
    groups = ds_moe.configure_expert_parallelism(model, mpu=mpu)
    full = {k: v.detach() for k, v in reference.state_dict().items()}
    model.load_state_dict(ds_moe.expert_parallel_state_dict(model, full, groups))
    loss, out, counts = _loss(model, dp_rank)
    loss.backward()
    ds_moe.all_reduce_gradients(model, groups)

    want_out, want_l_aux, want_counts = expected[dp_rank]
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.deepspeed_moe.l_aux, want_l_aux)
    assert torch.equal(counts, want_counts), (counts, want_counts)
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    grads = {n: p.grad for n, p in model.named_parameters()}
    local_ref = ds_moe.expert_parallel_state_dict(model, ref_grads, groups)
    assert grads.keys() == local_ref.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, local_ref[name], rtol=1e-5, atol=1e-6, msg=name)
    return counts.tolist()


CASES = [
    pytest.param(1, 1, 1, id="world1-ep1"),
    pytest.param(2, 2, 1, id="world2-ep2"),
    pytest.param(4, 4, 1, id="world4-ep4"),
    pytest.param(4, 2, 1, id="world4-ep2"),  # expert data parallelism: experts replicated twice
    pytest.param(4, 2, 2, id="world4-tp2-ep2"),  # an mpu: groups within each tensor slice
]
POLICIES = [
    pytest.param({"use_rts": False, "capacity_factor": 0.5, "min_capacity": 0}, id="first-come"),
    pytest.param({"capacity_factor": 0.5, "min_capacity": 0}, id="rts"),
    pytest.param({"drop_tokens": False}, id="no-drop"),
    pytest.param({"noisy_gate_policy": "Jitter", "min_capacity": 2}, id="jitter"),
    pytest.param({"noisy_gate_policy": "RSample", "use_residual": True}, id="rsample-residual"),
]


@pytest.mark.parametrize("moe_kwargs", POLICIES)
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize(("world_size", "ep_size", "tp"), CASES)
def test_matches_single_process_reference(
    world_size: int, ep_size: int, tp: int, k: int, moe_kwargs: dict
) -> None:
    counts = run_on_ranks(
        _parity_body, world_size, ep_size=ep_size, k=k, moe_kwargs=moe_kwargs, tp=tp, timeout=300
    )
    assert all(sum(c) <= k * BATCH[0] * BATCH[1] for c in counts)


def _unconfigured_body(rank: int, world_size: int) -> str:
    model = _reference(1, ep_size=2)
    try:
        model(torch.randn(4, HIDDEN))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_forward_without_groups_names_the_fix() -> None:
    (message,) = run_on_ranks(_unconfigured_body, 1)
    assert "configure_expert_parallelism" in message


def _too_large_ep_body(rank: int, world_size: int) -> str:
    import ds_moe
    from ds_comm import ConfigError

    try:
        ds_moe.configure_expert_parallelism(_reference(1, ep_size=4))
    except ConfigError as exc:
        return str(exc)
    return "no error"


def test_ep_size_larger_than_data_parallel_raises() -> None:
    messages = run_on_ranks(_too_large_ep_body, 2)
    assert all("ep_size = 4 must divide the data-parallel size 2" in m for m in messages)
