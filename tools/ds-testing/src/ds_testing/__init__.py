"""Multi-rank pytest harness: run a test body on N gloo ranks with reusable workers."""

from __future__ import annotations

from ds_testing.api import DistributedTestFailure, gpu_count, preload, run_on_ranks

__version__ = "0.2.0"

__all__ = [
    # running a body on N ranks
    "run_on_ranks",
    "DistributedTestFailure",
    "preload",
    # environment
    "gpu_count",
    "__version__",
]
