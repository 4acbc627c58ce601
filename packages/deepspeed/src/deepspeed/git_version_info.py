"""``deepspeed.git_version_info``: the version this alias distribution reports.

``version`` is the DeepSpeed release whose public surface ds reproduces (0.19.8), not ds's own
version: transformers and accelerate compare it with the DeepSpeed versions they support. A
DeepSpeed wheel built outside a git checkout reports ``"unknown"`` for the git fields; this
distribution is built the same way, so it does too.
"""

from __future__ import annotations

__all__ = ["git_branch", "git_hash", "version"]

version = "0.19.8"
git_hash = "unknown"
git_branch = "unknown"
