"""ds-kernels: Triton kernels, each with a torch reference and a dispatcher.

Every kernel is a dispatcher that runs the Triton kernel on CUDA tensors it supports when Triton
imports, and the torch reference otherwise (CPU tensors, other dtypes, no Triton). Triton is an
optional dependency (``ds-kernels[triton]``).
"""

from __future__ import annotations

from ds_kernels._adam import adam, adam_reference
from ds_kernels._moe_combine import (
    moe_combine,
    moe_combine_reference,
    moe_combine_weight_grad,
    moe_combine_weight_grad_reference,
)
from ds_kernels._moe_dispatch import moe_dispatch, moe_dispatch_reference
from ds_kernels._quantize import (
    QuantizedBlocks,
    dequantize_blockwise,
    dequantize_blockwise_reference,
    quantize_blockwise,
    quantize_blockwise_reference,
    quantized_nbytes,
)
from ds_kernels._scaled_add import scaled_add, scaled_add_reference
from ds_kernels._triton import triton_available
from ds_kernels.api import Backend

__version__ = "0.2.0"

__all__ = [
    # kernels, each with its torch reference
    "scaled_add",
    "scaled_add_reference",
    "adam",
    "adam_reference",
    # mixture-of-experts routing (token <-> expert slot)
    "moe_dispatch",
    "moe_dispatch_reference",
    "moe_combine",
    "moe_combine_reference",
    "moe_combine_weight_grad",
    "moe_combine_weight_grad_reference",
    # blockwise int8/int4 quantization (ZeRO++ qwZ/qgZ wire format)
    "quantize_blockwise",
    "quantize_blockwise_reference",
    "dequantize_blockwise",
    "dequantize_blockwise_reference",
    "quantized_nbytes",
    "QuantizedBlocks",
    # dispatch
    "Backend",
    "triton_available",
    "__version__",
]
