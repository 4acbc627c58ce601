"""``deepspeed.zero``: ZeRO stage 3 helpers, re-exported from ds-zero.

``Init`` partitions modules while they are built, ``GatheredParameters`` gathers partitioned
parameters for a moment (reading or re-initialising weights), and
``register_external_parameter`` names a parameter a module uses without owning it. Set
``zero_optimization.stage`` to 3 in the config to train a model built this way.
"""

from __future__ import annotations

from ds_zero import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    register_external_parameter,
    unregister_external_parameter,
)

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "register_external_parameter",
    "unregister_external_parameter",
]
