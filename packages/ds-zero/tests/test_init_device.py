"""zero.Init partitions straight onto the accelerator's current device (DeepSpeed's
``local_device``), and keeps shards in host memory when parameters are offloaded
(``offload_param`` or ``remote_device``). CPU proves the choice through an accelerator whose
current device is ``meta`` (the devices Init's partitioner uses), and the values and devices of
shards built on two gloo ranks; the GPU tier (``ds-engine/tests/test_gpu.py``) proves the
placement on CUDA."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from ds_comm.accelerator import CPU_Accelerator, get_accelerator, set_accelerator
from ds_testing import run_on_ranks
from ds_zero import GatheredParameters, Init
from ds_zero._init import init_device

STAGE3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


class _MetaAccelerator(CPU_Accelerator):
    """A CPU accelerator whose current device is ``meta``."""

    def current_device_name(self) -> str:
        return "meta"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device("meta")


@pytest.fixture
def meta_accelerator() -> Iterator[None]:
    saved = get_accelerator()
    set_accelerator(_MetaAccelerator())
    try:
        yield
    finally:
        set_accelerator(saved)


def test_init_device_is_the_accelerators_current_device(meta_accelerator: None) -> None:
    assert init_device() == torch.device("meta")


def test_init_partitions_onto_the_accelerators_device(meta_accelerator: None) -> None:
    init = Init(config_dict_or_path=STAGE3)
    assert init.partitioner is not None
    assert init.partitioner.compute_device == torch.device("meta")
    p = nn.Parameter(torch.ones(3))
    assert init.partitioner.shard_device(p) == torch.device("meta")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"remote_device": "cpu"},
        {
            "config_dict_or_path": {
                "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}
            }
        },
    ],
    ids=["remote_device", "offload_param"],
)
def test_offloaded_shards_stay_in_host_memory(
    meta_accelerator: None, kwargs: dict[str, Any]
) -> None:
    init = Init(**kwargs)
    assert init.partitioner is not None
    p = nn.Parameter(torch.ones(3))
    assert init.partitioner.shard_device(p) == torch.device("cpu")
    # gathered values still land on the compute device
    assert init.partitioner.compute_device == torch.device("meta")


def _placement_body(rank: int, world_size: int, *, remote_device: str | None) -> bool:
    torch.manual_seed(rank)  # rank 0's values win
    with Init(config_dict_or_path=STAGE3, remote_device=remote_device):
        model = nn.Linear(5, 3)
    device = torch.device(get_accelerator().current_device_name())
    shard_device = torch.device("cpu") if remote_device else device
    torch.manual_seed(0)
    reference = nn.Linear(5, 3)
    for p in model.parameters():
        assert p.ds_tensor.device == shard_device, p.ds_tensor.device
        assert p.device == device and p.numel() == 0
    with GatheredParameters(list(model.parameters())):
        for p, q in zip(model.parameters(), reference.parameters()):
            assert p.device == device
            torch.testing.assert_close(p.detach().cpu(), q.detach())
    return True


@pytest.mark.parametrize("remote_device", [None, "cpu"])
def test_partitioned_values_and_devices_on_two_ranks(remote_device: str | None) -> None:
    assert run_on_ranks(_placement_body, 2, remote_device=remote_device) == [True, True]
