"""``deepspeed.sequence``: Ulysses sequence parallelism.

``layer`` holds :class:`~ds_engine.sequence.layer.DistributedAttention` (DeepSpeed's
``deepspeed.sequence.layer.DistributedAttention``); :func:`sequence_parallel_loss` averages a
loss over the sequence group by tokens; :class:`UlyssesSPDataLoaderAdapter` (also at DeepSpeed's
``deepspeed.runtime.sequence_parallel.ulysses_sp``) gives each rank its slice of the sequence.
See docs/sequence_parallel.md.
"""

from __future__ import annotations

from ds_engine.sequence import layer
from ds_engine.sequence._loader import UlyssesSPDataLoaderAdapter, shard_sequence
from ds_engine.sequence._loss import sequence_parallel_loss
from ds_engine.sequence.layer import DistributedAttention

__all__ = [
    # modules
    "layer",
    # attention
    "DistributedAttention",
    # data and loss
    "UlyssesSPDataLoaderAdapter",
    "sequence_parallel_loss",
    "shard_sequence",
]
