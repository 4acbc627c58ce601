"""ZeRO-Offload: fp32 partitions, gradients and optimizer state in host memory, stepped by
CPUAdam; with nvme the optimizer state is swapped out between steps (ds-offload-aio's
AsyncTensorSwapper by default, or any TensorSwapper)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _ds_zero_testing import (
    Recipe,
    adam,
    cpu_adam,
    global_batches,
    make_model,
    micro_batches,
    parameter_error,
    reference_train,
)

STEPS, ROWS = 6, 16


class FileSwapper:
    """A TensorSwapper over torch.save files, counting its writes."""

    def __init__(self) -> None:
        self.writes = 0

    def swap_out(self, tensors, paths, *, async_op: bool = False) -> None:
        import torch

        for tensor, path in zip(tensors, paths):
            torch.save(tensor.clone(), path)
            self.writes += 1

    def swap_in(self, tensors, paths, *, async_op: bool = False) -> None:
        import torch

        for tensor, path in zip(tensors, paths):
            tensor.copy_(torch.load(path, weights_only=True))

    def wait(self) -> None:
        pass


def _nvme_body(rank: int, world_size: int, *, root: str, stage: int, custom: bool) -> dict:
    import torch

    from ds_zero import TensorSwapper, ZeroConfig, ZeroOptimizer

    swapper = FileSwapper() if custom else None
    model = make_model(torch.float32)
    offload = {"device": "nvme", "nvme_path": root, "pin_memory": True}
    config = ZeroConfig(stage=stage, reduce_bucket_size=1500, offload_optimizer=offload)
    zero = ZeroOptimizer(model, cpu_adam(list(model.parameters())), config, swapper=swapper)
    assert isinstance(zero._swap.swapper, TensorSwapper)
    for batch in global_batches(STEPS, ROWS):
        zero.backward(model(next(micro_batches(batch, rank, world_size, 1))))
        zero.step()
        # Between steps only the fp32 masters stay in memory; the moments are in files.
        state = zero.memory_breakdown().optimizer_state
        assert state == sum(m.nbytes for m in zero.masters), state
    reference = reference_train(
        make_model(torch.float32), global_batches(STEPS, ROWS), Recipe(adam)
    )
    saved = zero.state_dict()  # swaps in to read the moments, and out again
    moments = saved["optimizer"]["state"][0]
    files = sorted(p.name for p in (Path(root) / "ds_zero" / f"rank{rank}").iterdir())
    return {
        "error": parameter_error(model, reference),
        "writes": swapper.writes if custom else None,
        "moments": sorted(k for k, v in moments.items() if v.numel() > 1),
        "files": files,
    }


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("stage", [1, 2])
def test_nvme_offload_swaps_state_and_trains_like_the_reference(
    tmp_path: Path, world_size: int, stage: int
) -> None:
    results = run_on_ranks(
        _nvme_body, world_size, root=str(tmp_path), stage=stage, custom=False, timeout=300
    )
    for result in results:
        assert result["error"] <= 1e-5
        assert result["moments"] == ["exp_avg", "exp_avg_sq"]
        assert result["files"] == ["group0_exp_avg.swp", "group0_exp_avg_sq.swp"]


def test_a_custom_swapper_is_used(tmp_path: Path) -> None:
    (result,) = run_on_ranks(_nvme_body, 1, root=str(tmp_path), stage=2, custom=True, timeout=300)
    assert result["error"] <= 1e-5
    assert result["writes"] == 2 * (STEPS + 1)  # exp_avg, exp_avg_sq per step + state_dict
