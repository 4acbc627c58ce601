"""``deepspeed.runtime.zero`` (also ``deepspeed.zero``): ZeRO from ds-zero.

``Init`` partitions modules while they are built, ``GatheredParameters`` gathers partitioned
parameters for a moment, ``register_external_parameter`` names a parameter a module uses without
owning it. Submodules: ``partition_parameters``, ``config``, ``offload_config``,
``offload_states``, ``stage3``, ``stage_1_and_2``.
"""

from __future__ import annotations

from ds_zero import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    register_external_parameter,
    unregister_external_parameter,
)

# isort: split
from ds_engine.runtime.zero import (
    config,
    offload_config,
    offload_states,
    partition_parameters,
    stage3,
    stage_1_and_2,
)

__all__ = [
    # stage 3 helpers
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "register_external_parameter",
    "unregister_external_parameter",
    # submodules
    "config",
    "offload_config",
    "offload_states",
    "partition_parameters",
    "stage3",
    "stage_1_and_2",
]
