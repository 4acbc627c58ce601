"""``stage3_param_persistence_threshold`` as DeepSpeed applies it: ``zero.Init`` partitions every
parameter (the config may still say ``"auto"`` there, as transformers passes it), and the stage 3
engine marks the small ones persistent with its resolved threshold when it takes the model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ds_testing import run_on_ranks
from ds_zero import GatheredParameters, Init, Stage3Optimizer, ZeroConfig, ZeroParamStatus

# transformers' zero.Init call: the hidden-size-based keys are still "auto".
HF_UNRESOLVED = {
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
    }
}


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _auto_threshold_body(rank: int, world_size: int) -> None:
    torch.manual_seed(7)
    reference = _model()
    torch.manual_seed(7 + rank)  # rank 0's values win under Init
    with Init(config_dict_or_path=HF_UNRESOLVED):
        model = _model()
    # Every parameter is partitioned at Init, however small (DeepSpeed does the same).
    for name, p in model.named_parameters():
        assert p.ds_status is ZeroParamStatus.NOT_AVAILABLE and p.numel() == 0, name
        assert not p.ds_persist, name
    # The client resolves "auto" (transformers: 10 * hidden_size) before initialize.
    config = ZeroConfig.from_dict({"stage": 3, "stage3_param_persistence_threshold": 40})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    zero = Stage3Optimizer(model, optimizer, config)
    persistent = {n for n, p in model.named_parameters() if p.ds_persist}
    assert persistent == {"0.bias", "2.bias"}  # 32 and 4 elements; weights are 512 and 128
    for name, p in model.named_parameters():
        whole = name in persistent
        assert (p.ds_status is ZeroParamStatus.AVAILABLE) == whole, name
        assert p.numel() == (p.ds_numel if whole else 0), name
    assert zero.partitioner.gathered_numel == 0  # persistent ones are not in the live count
    with GatheredParameters(model.parameters()):
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.data, q.data, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("world_size", [1, 2])
def test_init_partitions_everything_and_the_engine_applies_the_threshold(world_size: int) -> None:
    run_on_ranks(_auto_threshold_body, world_size)
