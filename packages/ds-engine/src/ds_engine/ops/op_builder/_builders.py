"""ds's op builders, one per DeepSpeed op name (see [Note: op builders without a JIT])."""

from __future__ import annotations

import importlib.util

import torch

from ds_engine.ops.op_builder.builder import NotImplementedBuilder, OpBuilder

# --- ops ds provides ------------------------------------------------------------------------------


class CPUAdamBuilder(OpBuilder):
    """``load()``: ds-native, whose ``adam_step`` is the C (AVX-512/AVX2) CPU Adam kernel."""

    NAME = "cpu_adam"
    MODULE = "ds_native"
    FEATURE = "CPU Adam, ds-native's C kernel"

    def _incompatible_reason(self) -> str | None:
        import ds_native

        if ds_native.native_available():
            return None
        return f"ds-native's C extension is not built: {ds_native.build_info()['reason']}"


class FusedAdamBuilder(OpBuilder):
    """``load()``: ds-kernels, whose ``adam`` runs the Triton kernel on GPUs and its torch
    reference elsewhere."""

    NAME = "fused_adam"
    MODULE = "ds_kernels"
    FEATURE = "fused Adam, ds-kernels"


class FusedLambBuilder(OpBuilder):
    """``load()``: ds-optim, whose ``FusedLamb`` is multi-tensor torch code."""

    NAME = "fused_lamb"
    MODULE = "ds_optim"
    FEATURE = "fused LAMB, ds-optim"


class FusedLionBuilder(OpBuilder):
    """``load()``: ds-optim, whose ``Lion`` is multi-tensor torch code on any device."""

    NAME = "fused_lion"
    MODULE = "ds_optim"
    FEATURE = "fused Lion, ds-optim"


class CPULionBuilder(OpBuilder):
    """``load()``: ds-optim, whose ``Lion`` runs on CPU parameters too."""

    NAME = "cpu_lion"
    MODULE = "ds_optim"
    FEATURE = "CPU Lion, ds-optim"


class CPUAdagradBuilder(OpBuilder):
    """``load()``: ds-optim, whose ``Adagrad`` runs on CPU parameters too."""

    NAME = "cpu_adagrad"
    MODULE = "ds_optim"
    FEATURE = "CPU Adagrad, ds-optim"


class AsyncIOBuilder(OpBuilder):
    """``load()``: ds-offload-aio, whose ``aio_handle`` is DeepSpeed's handle (libaio, else a
    thread pool of ``os.preadv`` workers)."""

    NAME = "async_io"
    MODULE = "ds_offload_aio"
    FEATURE = "async tensor file I/O, ds-offload-aio"


class GDSBuilder(OpBuilder):
    """``load()``: ds-offload-aio, whose ``GdsHandle`` moves CUDA tensors with cuFile (kvikio)."""

    NAME = "gds"
    MODULE = "ds_offload_aio"
    FEATURE = "GPUDirect Storage, ds-offload-aio"

    def _incompatible_reason(self) -> str | None:
        if not torch.cuda.is_available():
            return "GPUDirect Storage needs a CUDA device"
        if importlib.util.find_spec("kvikio") is None:
            return "kvikio is not installed (pip install kvikio-cu12)"
        return super()._incompatible_reason()


# --- ops ds does not implement --------------------------------------------------------------------


def _refused(class_name: str, name: str, feature: str) -> type[NotImplementedBuilder]:
    return type(class_name, (NotImplementedBuilder,), {"NAME": name, "FEATURE": feature})


TransformerBuilder = _refused(
    "TransformerBuilder", "transformer", "fused transformer layer kernels"
)
StochasticTransformerBuilder = _refused(
    "StochasticTransformerBuilder", "stochastic_transformer", "stochastic transformer kernels"
)
InferenceBuilder = _refused(
    "InferenceBuilder", "transformer_inference", "transformer inference kernels"
)
SpatialInferenceBuilder = _refused(
    "SpatialInferenceBuilder", "spatial_inference", "spatial inference kernels"
)
InferenceCoreBuilder = _refused(
    "InferenceCoreBuilder", "inference_core_ops", "inference v2 core kernels"
)
InferenceCutlassBuilder = _refused(
    "InferenceCutlassBuilder", "cutlass_ops", "inference v2 CUTLASS kernels"
)
RaggedOpsBuilder = _refused("RaggedOpsBuilder", "ragged_device_ops", "inference v2 ragged kernels")
RaggedUtilsBuilder = _refused("RaggedUtilsBuilder", "ragged_ops", "inference v2 ragged utilities")
QuantizerBuilder = _refused("QuantizerBuilder", "quantizer", "quantization kernels")
FPQuantizerBuilder = _refused("FPQuantizerBuilder", "fp_quantizer", "FP8/FP6 quantization kernels")
RandomLTDBuilder = _refused("RandomLTDBuilder", "random_ltd", "random layer-token drop kernels")
EvoformerAttnBuilder = _refused(
    "EvoformerAttnBuilder", "evoformer_attn", "DS4Science Evoformer attention"
)
DeepCompileBuilder = _refused("DeepCompileBuilder", "dc", "DeepCompile kernels")
UtilsBuilder = _refused(
    "UtilsBuilder", "utils", "the flatten/unflatten extension (use torch._utils)"
)
PinMemoryBuilder = _refused(
    "PinMemoryBuilder", "pin_memory", "the pin-memory extension (use get_accelerator().pin_memory)"
)
ShareMemCommBuilder = _refused(
    "ShareMemCommBuilder", "deepspeed_shm_comm", "the shared-memory comm extension"
)
CCLCommBuilder = _refused("CCLCommBuilder", "deepspeed_ccl_comm", "the oneCCL comm extension")

NOT_IMPLEMENTED = [
    TransformerBuilder,
    StochasticTransformerBuilder,
    InferenceBuilder,
    SpatialInferenceBuilder,
    InferenceCoreBuilder,
    InferenceCutlassBuilder,
    RaggedOpsBuilder,
    RaggedUtilsBuilder,
    QuantizerBuilder,
    FPQuantizerBuilder,
    RandomLTDBuilder,
    EvoformerAttnBuilder,
    DeepCompileBuilder,
    UtilsBuilder,
    PinMemoryBuilder,
    ShareMemCommBuilder,
    CCLCommBuilder,
]

PROVIDED = [
    CPUAdamBuilder,
    FusedAdamBuilder,
    FusedLambBuilder,
    FusedLionBuilder,
    CPULionBuilder,
    CPUAdagradBuilder,
    AsyncIOBuilder,
    GDSBuilder,
]
