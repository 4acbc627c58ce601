"""ZeRO++ at stage 3 on 2 and 4 gloo ranks: qwZ (int8 weight all-gathers), qgZ (int8 all-to-all
gradient reduction) and hpZ (backward re-gathers within a secondary partition), each trained
next to plain ZeRO-3 on the same batches in the same rank.

Tolerances: hpZ only changes which ranks a backward gathers from, so it must equal plain ZeRO-3
exactly. qwZ and qgZ round weights or gradients to int8 with one scale per block of 256 (a
relative error of at most 1/254 of a block's largest value per element): after STEPS steps of
Adam the loss stays within LOSS_TOLERANCE (relative) of plain ZeRO-3's (measured: 0.1%), and
the weights within WEIGHT_TOLERANCE in relative L2 norm over the whole model (measured: 1-2%;
Adam turns rounding of the tiniest gradients, a bias's, into whole steps, up to 5% of such a
tensor).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _ds_zero_testing import adam, global_batches, make_model, micro_batches

STEPS = 4
ROWS = 16
LOSS_TOLERANCE = 0.01
WEIGHT_TOLERANCE = 0.05


def _section(**zeropp: Any) -> dict[str, Any]:
    return {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,  # every parameter travels through the hooks
        "stage3_max_reuse_distance": 0,
        "reduce_bucket_size": 4000,
        **zeropp,
    }


def _train(rank: int, world_size: int, section: dict[str, Any], accum: int = 1) -> dict[str, Any]:
    """Train STEPS steps; the losses of the last step, the whole weights and the wire bytes by
    op and group size."""
    import ds_comm
    from ds_zero import Stage3Optimizer, ZeroConfig

    model = make_model(torch.float32)
    zero = Stage3Optimizer(
        model,
        adam(list(model.parameters())),
        ZeroConfig.from_dict(section),
        gradient_accumulation_steps=accum,
    )
    logger = ds_comm.get_comms_logger()
    previous = ds_comm.configure(enabled=True, prof_all=True)
    logger.reset()
    losses = []
    try:
        for batch in global_batches(STEPS, ROWS):
            total = 0.0
            for micro in micro_batches(batch, rank, world_size, accum):
                loss = model(micro)
                zero.backward(loss)
                total += loss.item() / accum
            assert not zero.step().skipped
            losses.append(total)
        wire: dict[tuple[str, int], float] = {}
        for row in logger.summary():
            key = (row.op, row.group_size)
            wire[key] = wire.get(key, 0.0) + row.wire_bytes
    finally:
        ds_comm.configure(previous)
        logger.reset()
    params = list(model.parameters())
    zero.partitioner.gather(params).wait()
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    zero.partitioner.release(params)
    zero.destroy()
    return {"losses": losses, "state": state, "wire": wire}


def _worst(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """Relative L2 distance of the whole model's weights."""
    diff = sum(((state[n] - ref) ** 2).sum() for n, ref in reference.items())
    norm = sum((ref**2).sum() for ref in reference.values())
    return float((diff / norm).sqrt())


def _wire(result: dict[str, Any], op: str) -> float:
    return sum(v for (name, _), v in result["wire"].items() if name == op)


def _quantized_body(rank: int, world_size: int, *, accum: int) -> dict[str, float]:
    """qwZ and qgZ next to plain ZeRO-3: loss and weights within tolerance, bytes cut 3x."""
    plain = _train(rank, world_size, _section(), accum)
    # qwZ: int8 weight gathers; the reduce-scatters are plain ZeRO-3's
    qwz = _train(rank, world_size, _section(zero_quantized_weights=True), accum)
    # qgZ: int8 all-to-all reduction; no reduce-scatter left
    qgz = _train(rank, world_size, _section(zero_quantized_gradients=True), accum)
    out: dict[str, float] = {}
    for name, result in (("qwZ", qwz), ("qgZ", qgz)):
        loss_error = abs(result["losses"][-1] - plain["losses"][-1]) / plain["losses"][-1]
        assert loss_error <= LOSS_TOLERANCE, (name, result["losses"], plain["losses"])
        weight_error = _worst(result["state"], plain["state"])
        assert weight_error <= WEIGHT_TOLERANCE, (name, weight_error)
        assert result["losses"][-1] < result["losses"][0]  # it trains
        out[name] = loss_error
    gathered = _wire(plain, "all_gather_into_tensor")
    assert _wire(qwz, "all_gather_into_tensor") * 3 <= gathered
    assert _wire(qwz, "reduce_scatter_tensor") == _wire(plain, "reduce_scatter_tensor")
    assert _wire(qgz, "reduce_scatter_tensor") == 0
    assert _wire(qgz, "all_to_all_single") * 3 <= _wire(plain, "reduce_scatter_tensor")
    return out


def _hpz_body(rank: int, world_size: int, *, accum: int, with_qwz: bool) -> None:
    """hpZ changes only who gathers in backward: exactly the numbers of the same run without
    it (with qwZ too: the secondary holds the forward's dequantized weights)."""
    base = _section(zero_quantized_weights=with_qwz)
    reference = _train(rank, world_size, base, accum)
    hpz = _train(rank, world_size, {**base, "zero_hpz_partition_size": 2}, accum)
    assert hpz["losses"] == reference["losses"]
    assert _worst(hpz["state"], reference["state"]) == 0.0
    within = hpz["wire"].get(("all_gather_into_tensor", 2), 0.0)
    assert within > 0  # the backward's gathers stay within groups of 2 ranks
    across = _wire(hpz, "all_gather_into_tensor") - within
    assert across < _wire(reference, "all_gather_into_tensor")


def test_qwz_and_qgz_match_zero3_on_2_ranks() -> None:
    errors = run_on_ranks(_quantized_body, 2, accum=1, timeout=600)
    assert len(errors) == 2


def test_hpz_equals_zero3_on_4_ranks() -> None:
    run_on_ranks(_hpz_body, 4, accum=1, with_qwz=False, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("world_size, accum", [(4, 1), (2, 2), (4, 2)])
def test_qwz_and_qgz_match_zero3(world_size: int, accum: int) -> None:
    run_on_ranks(_quantized_body, world_size, accum=accum, timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("accum, with_qwz", [(1, True), (2, False), (2, True)])
def test_hpz_equals_zero3_with_qwz_and_accumulation(accum: int, with_qwz: bool) -> None:
    run_on_ranks(_hpz_body, 4, accum=accum, with_qwz=with_qwz, timeout=900)


def _hpz_size_body(rank: int, world_size: int) -> str:
    from ds_zero import Stage3Optimizer, ZeroConfig

    model = make_model(torch.float32)
    section = _section(zero_hpz_partition_size=3)
    with pytest.raises(ValueError, match="zero_hpz_partition_size = 3 does not divide") as info:
        Stage3Optimizer(model, adam(list(model.parameters())), ZeroConfig.from_dict(section))
    return str(info.value)


def test_hpz_size_must_divide_the_data_parallel_size() -> None:
    run_on_ranks(_hpz_size_body, 2, timeout=120)


@pytest.mark.parametrize(
    "key, value", [("zero_quantized_weights", True), ("zero_quantized_gradients", True)]
)
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_zeropp_is_refused_below_stage_3(key: str, value: Any, stage: int) -> None:
    from ds_zero import ConfigError, ZeroConfig

    with pytest.raises(ConfigError, match=f"{key} = True is a feature of stage 3"):
        ZeroConfig.from_dict({"stage": stage, key: value})


def test_hpz_is_refused_below_stage_3_and_checked() -> None:
    from ds_zero import ConfigError, ZeroConfig

    with pytest.raises(ConfigError, match="zero_hpz_partition_size = 4 is a feature of stage 3"):
        ZeroConfig.from_dict({"stage": 2, "zero_hpz_partition_size": 4})
    with pytest.raises(ConfigError, match="zero_hpz_partition_size = 0: expected an integer"):
        ZeroConfig.from_dict({"stage": 3, "zero_hpz_partition_size": 0})
    config = ZeroConfig.from_dict({"stage": 3, "zero_hpz_partition_size": 1})
    assert config.zero_hpz_partition_size == 1 and not config.zero_quantized_weights
