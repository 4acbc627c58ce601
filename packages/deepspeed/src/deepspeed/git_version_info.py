"""``deepspeed.git_version_info``: the version this alias distribution reports.

``version`` is the DeepSpeed release whose public surface ds reproduces (0.19.8), not ds's own
version: transformers and accelerate compare it with the DeepSpeed versions they support. A
DeepSpeed wheel built outside a git checkout reports ``"unknown"`` for the git fields; this
distribution is built the same way, so it does too.

``installed_ops`` and ``compatible_ops`` (op name -> bool) are computed on first access from
``deepspeed.ops.op_builder``: ds builds its kernels when its packages install, so an op is
installed exactly when it can run here.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "compatible_ops",  # noqa: F822  (module __getattr__)
    "git_branch",
    "git_hash",
    "installed_ops",  # noqa: F822
    "torch_info",  # noqa: F822
    "version",
]

version = "0.19.8"
git_hash = "unknown"
git_branch = "unknown"


def __getattr__(name: str) -> Any:
    if name in ("installed_ops", "compatible_ops"):
        from ds_engine.ops.op_builder.all_ops import ALL_OPS

        return {op: builder.is_compatible() for op, builder in ALL_OPS.items()}
    if name == "torch_info":
        import torch

        return {
            "version": torch.__version__.split("+")[0],
            "cuda_version": torch.version.cuda or "0.0",
            "hip_version": torch.version.hip or "0.0",
        }
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
