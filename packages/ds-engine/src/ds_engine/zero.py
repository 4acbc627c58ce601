"""``deepspeed.zero``: ZeRO stage 3 helpers, the same objects as ``deepspeed.runtime.zero``.

``Init`` partitions modules while they are built, ``GatheredParameters`` gathers partitioned
parameters for a moment (reading or re-initialising weights), and
``register_external_parameter`` names a parameter a module uses without owning it. Set
``zero_optimization.stage`` to 3 in the config to train a model built this way. As in DeepSpeed,
``deepspeed.zero.partition_parameters`` and the other submodules of ``runtime.zero`` are
attributes here.
"""

from __future__ import annotations

from ds_engine.runtime.zero import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    config,
    offload_config,
    partition_parameters,
    register_external_parameter,
    stage3,
    stage_1_and_2,
    unregister_external_parameter,
)

__all__ = [
    # stage 3 helpers
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "register_external_parameter",
    "unregister_external_parameter",
    # runtime.zero's submodules
    "config",
    "offload_config",
    "partition_parameters",
    "stage3",
    "stage_1_and_2",
]
