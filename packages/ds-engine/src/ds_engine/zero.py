"""``deepspeed.zero``: ZeRO stage 3 helpers, the same objects as ``deepspeed.runtime.zero``.

``Init`` partitions modules while they are built, ``GatheredParameters`` gathers partitioned
parameters for a moment (reading or re-initialising weights), and
``register_external_parameter`` names a parameter a module uses without owning it. Set
``zero_optimization.stage`` to 3 in the config to train a model built this way. As in DeepSpeed,
``deepspeed.zero.partition_parameters`` and the other submodules of ``runtime.zero`` are
attributes here.
"""

from __future__ import annotations

from ds_engine.runtime.zero import *  # noqa: F403  (the same names as runtime.zero, by design)
from ds_engine.runtime.zero import __all__ as __all__
