"""``deepspeed.runtime.sequence_parallel``: Ulysses' data adapter (``ulysses_sp``) and DeepSpeed's
sequence-parallel mpu (``parallel_state_sp``)."""

from __future__ import annotations

from ds_engine.runtime.sequence_parallel import parallel_state_sp, ulysses_sp

__all__ = ["parallel_state_sp", "ulysses_sp"]
