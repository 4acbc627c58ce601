"""``deepspeed.sequence``: Ulysses sequence parallelism's attention wrapper.

``layer`` holds :class:`~ds_engine.sequence.layer.DistributedAttention` (DeepSpeed's
``deepspeed.sequence.layer.DistributedAttention``).
"""

from __future__ import annotations

from ds_engine.sequence import layer
from ds_engine.sequence.layer import DistributedAttention

__all__ = [
    # modules
    "layer",
    # attention
    "DistributedAttention",
]
