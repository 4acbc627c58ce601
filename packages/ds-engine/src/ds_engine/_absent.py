"""DeepSpeedEngine names ds deliberately does not provide, each with its reason.

Reading one raises an ``AttributeError`` that names the method and says why (instead of
Python's bare "has no attribute"); ``hasattr`` is False, so code that probes for a feature
takes its fallback. ``tests/test_engine_surface.py`` checks that every other public name of
DeepSpeed 0.19.8's engine exists.
"""

from __future__ import annotations

__all__ = ["ABSENT", "absent_error"]

_REDUCTION = (
    "an internal of DeepSpeed's own gradient reduction; ds-zero reduces gradients (bucketed "
    "reduce-scatter/all-reduce) inside backward() and step(), with no separate call"
)
_DEEPCOMPILE = "DeepCompile (the 'compile' config's passes) is not implemented in ds"
_DATA_EFFICIENCY = (
    "random layer-token drop (data_efficiency.data_routing.random_ltd) is not implemented in ds"
)

ABSENT: dict[str, str] = {
    "all_gather_scalar": _REDUCTION,
    "allreduce_and_copy": _REDUCTION,
    "allreduce_bucket": _REDUCTION,
    "allreduce_gradients": _REDUCTION,
    "allreduce_no_retain": _REDUCTION,
    "buffered_allreduce_fallback": _REDUCTION,
    "sparse_all_gather": _REDUCTION,
    "sparse_allreduce": _REDUCTION,
    "sparse_allreduce_bucket": _REDUCTION,
    "sparse_allreduce_no_retain": _REDUCTION,
    "clip_fp32_gradients": (
        "ds-zero clips by the global norm inside step() (gradient_clipping); gradients do not "
        "live in the parameters' .grad to clip separately"
    ),
    "coalesce_grad_reduction": (
        "use no_sync() (stages 0 and 1) to accumulate locally and reduce once at the boundary"
    ),
    "scale": (
        "a manual loss.backward() outside engine.backward() is not supported; ds-zero's "
        "reduction hooks run inside engine.backward(loss)"
    ),
    "compile_autosp": _DEEPCOMPILE,
    "compile_autotp": _DEEPCOMPILE,
    "compile_zero_optimization_stage": _DEEPCOMPILE,
    "uses_parallelization_pass_only": _DEEPCOMPILE,
    "get_autosp_backend": _DEEPCOMPILE,
    "get_autotp_backend": _DEEPCOMPILE,
    "get_deepcompile_backend": _DEEPCOMPILE,
    "get_deepspeed_compile_backend": _DEEPCOMPILE,
    "get_compile_time": _DEEPCOMPILE,
    "register_compile_pass": _DEEPCOMPILE,
    "is_deepcompile_active": _DEEPCOMPILE + "; engine.compile() is a plain torch.compile",
    "random_ltd_initialize": _DATA_EFFICIENCY,
    "load_moe_state_dict": (
        "DeepSpeed's MoE checkpoint reader; load_checkpoint() restores ds-moe's expert files"
    ),
    "print_forward_breakdown": (
        "DeepSpeed's MoE forward-timing print; the comms logger and wall_clock_breakdown "
        "report ds's timings"
    ),
    "get_optimizer_configuration": (
        "an internal of DeepSpeed's optimizer factory; ds-optim builds optimizers from the "
        "'optimizer' config section"
    ),
    "optimizer_legacy_fusion": "the 'optimizer.legacy_fusion' key is not implemented in ds",
    "swap_tensor_config": (
        "the 'swap_tensor' section (DeepSpeed's pipelined NVMe swapping) is not implemented "
        "in ds; NVMe offload reads the 'aio' section (aio_config())"
    ),
}


def absent_error(owner: str, name: str) -> AttributeError:
    """The error for reading ``owner.name`` where ``name`` is in :data:`ABSENT`."""
    return AttributeError(f"{owner}.{name} is deliberately not provided by ds: {ABSENT[name]}")
