"""``deepspeed.runtime.sequence_parallel``: Ulysses' data adapter (``ulysses_sp``)."""

from __future__ import annotations

from ds_engine.runtime.sequence_parallel import ulysses_sp

__all__ = ["ulysses_sp"]
