"""``deepspeed.runtime.activation_checkpointing``: ``checkpointing`` is ``ds_engine.checkpointing``
(``deepspeed.checkpointing``), one module under both paths."""

from __future__ import annotations

import sys

from ds_engine import checkpointing

# ``import ...activation_checkpointing.checkpointing`` finds the same module object.
sys.modules[f"{__name__}.checkpointing"] = checkpointing

__all__ = ["checkpointing"]
