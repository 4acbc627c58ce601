"""``deepspeed.comm``: ds-comm's functional API (``import ds_engine.comm as dist``)."""

from __future__ import annotations

from ds_comm import *  # noqa: F403  (a namespace alias: exactly ds-comm's public API)
from ds_comm import __all__ as __all__
