"""What stage 3 frees, and when, on 1 and 2 gloo ranks: a module's gathered weights right after
its forward (even though autograd keeps views of them for backward), its outputs once backward
is done (without waiting for the garbage collector), and the gradient shards after each step.
Training still equals a single process.
"""

from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path

import pytest
import torch

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _ds_zero_testing import (
    Recipe,
    adam,
    global_batches,
    make_model,
    parameter_error,
    reference_train,
)

STEPS = 3
ROWS = 4
TOLERANCE = 1e-5  # fp32, elementwise relative to the tensor's largest element
PERSIST = 100  # layer norms and small biases stay whole


def _working_set_body(rank: int, world_size: int) -> None:
    import ds_zero

    model = make_model(torch.float32)
    config = ds_zero.ZeroConfig.from_dict(
        {
            "stage": 3,
            "stage3_param_persistence_threshold": PERSIST,
            "stage3_prefetch_bucket_size": 0,
            "stage3_max_reuse_distance": 0,
        }
    )
    zero = ds_zero.build_zero_optimizer(model, adam(list(model.parameters())), config)
    up = model.blocks[0].up
    seen: dict[str, object] = {}

    def inside_forward(module: torch.nn.Module, args: object, output: torch.Tensor) -> None:
        # Runs before stage 3's own forward hook: the weight is whole, the output is the raw one.
        seen["weight"] = module.weight.data
        seen["output"] = weakref.ref(output)

    handle = up.register_forward_hook(inside_forward, prepend=True)
    batches = global_batches(STEPS, ROWS)
    reference = reference_train(make_model(torch.float32), batches, Recipe(adam))
    gc.disable()  # nothing may depend on the collector to be freed
    try:
        for x in batches:
            loss = model(x.chunk(world_size)[rank])
            whole = seen.pop("weight")
            assert isinstance(whole, torch.Tensor) and whole.numel() == up.weight.ds_numel
            # autograd holds views of this storage for backward; it is freed all the same
            assert whole.untyped_storage().nbytes() == 0, "gathered weight kept after forward"
            del whole
            zero.backward(loss)
            del loss
            output = seen.pop("output")
            assert isinstance(output, weakref.ref)
            assert output() is None, "a module output outlived its backward"
            assert all(g is not None for g in zero.grad_shards)
            zero.step()
            assert all(g is None for g in zero.grad_shards), "gradient shards kept after step"
    finally:
        gc.enable()
        handle.remove()
    with ds_zero.GatheredParameters(list(model.parameters())):
        assert parameter_error(model, reference) <= TOLERANCE


@pytest.mark.parametrize("world_size", [1, 2])
def test_stage3_frees_weights_outputs_and_grads_early(world_size: int) -> None:
    run_on_ranks(_working_set_body, world_size, timeout=300)
