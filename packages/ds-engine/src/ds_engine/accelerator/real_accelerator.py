"""``deepspeed.accelerator.real_accelerator``: the same names as ``deepspeed.accelerator`` (ds-comm's
accelerator holds them all in one module)."""

from __future__ import annotations

from ds_comm.accelerator import *  # noqa: F403  (a namespace alias: exactly ds-comm's API)
from ds_comm.accelerator import __all__ as __all__
