"""Public types of ds_kernels."""

from __future__ import annotations

from typing import Literal

Backend = Literal["triton", "torch"]
"""Which implementation a dispatcher runs: the Triton kernel or the torch reference."""
