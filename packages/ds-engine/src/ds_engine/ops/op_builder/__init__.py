"""``deepspeed.ops.op_builder``: DeepSpeed's op builders over ds's prebuilt kernels.

``CPUAdamBuilder().load()`` returns ds-native (its C CPU Adam), ``AsyncIOBuilder().load()``
ds-offload-aio (DeepSpeed's ``aio_handle``), ``FusedAdamBuilder().load()`` ds-kernels; nothing
is compiled at run time (see [Note: op builders without a JIT] in ``builder``). Builders of ops
ds does not implement are present, report ``is_compatible() == False`` and refuse ``load()``.
Importing this module registers every builder with ds-comm's accelerator, so
``get_accelerator().create_op_builder("CPUAdamBuilder")`` finds them as in DeepSpeed.
"""

from __future__ import annotations

from ds_comm.accelerator import register_op_builder
from ds_engine.ops.op_builder._builders import (
    NOT_IMPLEMENTED,
    PROVIDED,
    AsyncIOBuilder,
    CCLCommBuilder,
    CPUAdagradBuilder,
    CPUAdamBuilder,
    CPULionBuilder,
    DeepCompileBuilder,
    EvoformerAttnBuilder,
    FPQuantizerBuilder,
    FusedAdamBuilder,
    FusedLambBuilder,
    FusedLionBuilder,
    GDSBuilder,
    InferenceBuilder,
    InferenceCoreBuilder,
    InferenceCutlassBuilder,
    PinMemoryBuilder,
    QuantizerBuilder,
    RaggedOpsBuilder,
    RaggedUtilsBuilder,
    RandomLTDBuilder,
    ShareMemCommBuilder,
    SpatialInferenceBuilder,
    StochasticTransformerBuilder,
    TransformerBuilder,
    UtilsBuilder,
)
from ds_engine.ops.op_builder.builder import NotImplementedBuilder, OpBuilder

for _builder in (*PROVIDED, *NOT_IMPLEMENTED):
    register_op_builder(_builder.__name__, _builder)

__all__ = [
    # base classes
    "OpBuilder",
    "NotImplementedBuilder",
    # ops ds provides
    "CPUAdamBuilder",
    "FusedAdamBuilder",
    "FusedLambBuilder",
    "FusedLionBuilder",
    "CPULionBuilder",
    "CPUAdagradBuilder",
    "AsyncIOBuilder",
    "GDSBuilder",
    # ops ds does not implement (load() refuses)
    "TransformerBuilder",
    "StochasticTransformerBuilder",
    "InferenceBuilder",
    "SpatialInferenceBuilder",
    "InferenceCoreBuilder",
    "InferenceCutlassBuilder",
    "RaggedOpsBuilder",
    "RaggedUtilsBuilder",
    "QuantizerBuilder",
    "FPQuantizerBuilder",
    "RandomLTDBuilder",
    "EvoformerAttnBuilder",
    "DeepCompileBuilder",
    "UtilsBuilder",
    "PinMemoryBuilder",
    "ShareMemCommBuilder",
    "CCLCommBuilder",
]
