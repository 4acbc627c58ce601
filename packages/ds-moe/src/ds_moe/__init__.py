"""ds-moe: mixture-of-experts layers (DeepSpeed's ``deepspeed.moe``), expert parallelism over
ds-comm all-to-all, fused token routing from ds-kernels, per-expert checkpoints and
Mixture-of-Students distillation."""

from __future__ import annotations

from ds_moe._checkpoint import (
    dense_state_dict,
    expert_checkpoint_name,
    expert_parallel_state_dict,
    global_expert_names,
    load_expert_states,
    load_moe_checkpoint,
    model_checkpoint_name,
    save_expert_states,
    save_moe_checkpoint,
)
from ds_moe._gating import TopKGate, capacity, route
from ds_moe._groups import (
    ExpertParallelGroups,
    all_reduce_gradients,
    configure_expert_parallelism,
    expert_topology,
)
from ds_moe._layer import Experts, MoE, MOELayer
from ds_moe._mos import MixtureOfStudents, kd_loss
from ds_moe._params import (
    has_moe_layers,
    is_moe_param,
    is_moe_param_group,
    split_params_grads_into_shared_and_expert_params,
    split_params_into_different_moe_groups_for_optimizer,
    split_params_into_shared_and_expert_params,
)
from ds_moe.api import ExpertGroup, GateConfig, MoSConfig, NoisyGatePolicy, Routing

__version__ = "0.2.0"

__all__ = [
    # layers
    "MoE",
    "MOELayer",
    "Experts",
    "TopKGate",
    # gating
    "GateConfig",
    "NoisyGatePolicy",
    "Routing",
    "route",
    "capacity",
    # expert parallelism
    "ExpertGroup",
    "ExpertParallelGroups",
    "configure_expert_parallelism",
    "expert_topology",
    "all_reduce_gradients",
    # expert vs dense parameters
    "is_moe_param",
    "is_moe_param_group",
    "has_moe_layers",
    "split_params_into_shared_and_expert_params",
    "split_params_grads_into_shared_and_expert_params",
    "split_params_into_different_moe_groups_for_optimizer",
    # checkpoints
    "save_moe_checkpoint",
    "load_moe_checkpoint",
    "save_expert_states",
    "load_expert_states",
    "dense_state_dict",
    "expert_parallel_state_dict",
    "global_expert_names",
    "expert_checkpoint_name",
    "model_checkpoint_name",
    # mixture of students
    "MoSConfig",
    "MixtureOfStudents",
    "kd_loss",
    "__version__",
]
