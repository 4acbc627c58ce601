"""``deepspeed.accelerator``: ds-comm's accelerator abstraction (``get_accelerator()`` and friends)."""

from __future__ import annotations

from ds_comm.accelerator import *  # noqa: F403  (a namespace alias: exactly ds-comm's API)
from ds_comm.accelerator import __all__ as __all__
