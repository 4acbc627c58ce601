"""``deepspeed.tp_model_init``: shard an unmodified ``nn.Module``'s linears over a tensor-parallel
group, and ``gather_tp_state_dict``, the inverse for saving merged weights.

The policy picks each ``nn.Linear``'s (and transformers ``Conv1D``'s) split by its name
(Llama/Mistral/GPT-2-style projection names) or by shape (a two-linear ``nn.Sequential`` MLP); a
user mapping overrides it. A fused projection (GPT-2's ``c_attn`` q|k|v, ``gate_up_proj``) is
split part by part, so every rank holds whole heads of q, k and v. Linears the policy does not
recognise stay whole (replicated), which is always correct, only not sharded.
"""

from __future__ import annotations

import copy
import fnmatch
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

import ds_comm
from ds_engine._autotp_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    is_conv1d,
    is_tensor_parallel_layer,
    merge_shards,
)

__all__ = ["gather_tp_state_dict", "merge_tp_state_dicts", "tp_layout", "tp_model_init"]

# Last name component -> split, for Llama/Mistral/Qwen/OPT/BERT/GPT-2-style blocks.
_COLUMN_NAMES = frozenset(
    {
        "q_proj",
        "k_proj",
        "v_proj",
        "gate_proj",
        "up_proj",
        "fc1",
        "query",
        "key",
        "value",
        "w1",
        "w3",
        "c_fc",
    }
)
_ROW_NAMES = frozenset({"o_proj", "down_proj", "out_proj", "fc2", "w2", "c_proj"})
# Fused projections: parts split one by one (GPT-2 c_attn and Phi-3 qkv_proj = q|k|v, with
# grouped-query k/v widths from the parent's head_dim/num_key_value_heads; gate_up_proj).
_FUSED_NAMES = {"c_attn": "qkv", "qkv_proj": "qkv", "gate_up_proj": "gate_up"}
_PARTS = {"qkv": 3, "gate_up": 2}
# Integer head-count attributes divided by tp_size on the parent of a column-split projection
# (split_size: GPT-2's per-part width of the fused c_attn output).
HEAD_ATTRIBUTES = (
    "num_heads",
    "num_attention_heads",
    "num_key_value_heads",
    "n_head",
    "n_heads",
    "split_size",
)
_CHOICES = ("column", "row", "skip", "qkv", "gate_up")


def _override(name: str, mapping: Mapping[str, str]) -> str | None:
    for pattern, choice in mapping.items():
        if fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, f"*.{pattern}"):
            if choice not in _CHOICES:
                raise ValueError(
                    f"tp_model_init: policy[{pattern!r}] = {choice!r} is not one of {_CHOICES}"
                )
            return choice
    return None


def _sequential_mlp(model: nn.Module) -> dict[str, str]:
    # nn.Sequential(Linear(d, h), <parameterless activation>, Linear(h, d)): column then row.
    found: dict[str, str] = {}
    for name, module in model.named_modules():
        children = list(module.children()) if isinstance(module, nn.Sequential) else []
        if len(children) != 3 or not all(isinstance(c, nn.Linear) for c in children[::2]):
            continue
        first, act, last = children
        if next(act.parameters(), None) is None and first.out_features == last.in_features:
            prefix = f"{name}." if name else ""
            found[f"{prefix}0"], found[f"{prefix}2"] = "column", "row"
    return found


def _plan(model: nn.Module, policy: Mapping[str, str] | None) -> dict[str, str]:
    """Module name -> "column" | "row" | "qkv" | "gate_up" for every linear to split."""
    mlp = _sequential_mlp(model)
    plan: dict[str, str] = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) and not is_conv1d(module):
            continue
        leaf = name.rsplit(".", 1)[-1]
        choice = _override(name, policy or {})
        if choice is None:
            choice = mlp.get(name)
        if choice is None and leaf in _FUSED_NAMES:
            choice = _FUSED_NAMES[leaf]
        if choice is None:
            choice = "column" if leaf in _COLUMN_NAMES else "row" if leaf in _ROW_NAMES else "skip"
        if choice != "skip":
            plan[name] = choice
    return plan


def _features(module: nn.Module) -> tuple[int, int]:
    """(in, out) features of an ``nn.Linear`` or a ``Conv1D``."""
    if is_conv1d(module):
        return int(module.nx), int(module.nf)  # type: ignore[arg-type]
    assert isinstance(module, nn.Linear)
    return module.in_features, module.out_features


def _sections(
    name: str, module: nn.Module, choice: str, parent: nn.Module
) -> tuple[int, ...] | None:
    if choice not in _PARTS:
        return None
    parts = _PARTS[choice]
    out = _features(module)[1]
    head_dim = getattr(parent, "head_dim", None)
    kv_heads = getattr(parent, "num_key_value_heads", None)
    if choice == "qkv" and isinstance(head_dim, int) and isinstance(kv_heads, int):
        kv = head_dim * kv_heads  # grouped-query attention: q|k|v of unequal widths
        if out - 2 * kv <= 0:
            raise ValueError(
                f"tp_model_init: {name!r} has out_features={out}, not q plus 2 x "
                f"{kv_heads} key/value heads of {head_dim}"
            )
        return (out - 2 * kv, kv, kv)
    if out % parts:
        raise ValueError(
            f"tp_model_init: {name!r} ({choice}) has out_features={out}, not {parts} equal parts"
        )
    return (out // parts,) * parts


def _default_group(tp_size: int) -> Any:
    world = ds_comm.get_world_size()
    if world % tp_size:
        raise ValueError(
            f"tp_model_init: tp_size={tp_size} does not divide the world size {world}; "
            "pass tp_group or a tp_size that divides it"
        )
    if tp_size == world:
        return None
    mine = None
    for start in range(0, world, tp_size):  # every rank creates every group, in order
        group = ds_comm.new_group(list(range(start, start + tp_size)))
        if start <= ds_comm.get_rank() < start + tp_size:
            mine = group
    return mine


def _check_untied(model: nn.Module, plan: Mapping[str, str]) -> None:
    # A weight shared with another module (a tied lm_head) cannot be split for one of them.
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(name)
    for name in plan:
        for param in model.get_submodule(name).parameters(recurse=False):
            others = [o for o in owners[id(param)] if o != name]
            if others:
                raise NotImplementedError(
                    f"tp_model_init: {name!r} shares a parameter with {others[0]!r} (tied "
                    "weights); splitting tied weights is not implemented. Map it to 'skip'."
                )


def _check_divisible(
    name: str, module: nn.Module, choice: str, tp_size: int, sections: tuple[int, ...] | None
) -> None:
    features_in, features_out = _features(module)
    if sections is not None:
        sizes, what = sections, "each fused part of out_features"
    elif choice == "row":
        sizes, what = (features_in,), "in_features"
    else:
        sizes, what = (features_out,), "out_features"
    for size in sizes:
        if size % tp_size:
            raise ValueError(
                f"tp_model_init: {name!r} ({choice}-parallel) has {what}={size}, "
                f"not divisible by tp_size={tp_size}; map it to 'skip' or choose a tp_size "
                "dividing it"
            )


def _divide_heads(module: nn.Module, name: str, tp_size: int) -> None:
    for attr in HEAD_ATTRIBUTES:
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            if value % tp_size:
                raise ValueError(
                    f"tp_model_init: {name or 'model'}.{attr}={value} is not divisible by "
                    f"tp_size={tp_size}"
                )
            setattr(module, attr, value // tp_size)
    config = getattr(module, "config", None)
    if isinstance(getattr(config, "num_attention_heads", None), int):
        # transformers modules that read head counts from their config (Phi-3's qkv split)
        # get a copy of their own with the local counts; the model's config stays whole.
        local = copy.copy(config)
        for attr in ("num_attention_heads", "num_key_value_heads"):
            value = getattr(config, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                if value % tp_size:
                    raise ValueError(
                        f"tp_model_init: {name or 'model'}.config.{attr}={value} is not "
                        f"divisible by tp_size={tp_size}"
                    )
                setattr(local, attr, value // tp_size)
        setattr(module, "config", local)  # noqa: B010 (nn.Module.__setattr__ typing)


def _refuse_moe(model: nn.Module, tp_size: int) -> None:
    """AutoTP of a model with MoE layers is not implemented: its experts would be split like
    dense linears, with no parity shown against the unsharded model. ds-moe is optional, so a
    model can only hold ``MoE`` layers when ``ds_moe`` was imported (as ``_moe.py`` reasons)."""
    ds_moe = sys.modules.get("ds_moe")
    if ds_moe is None:
        return
    for name, module in model.named_modules():
        if isinstance(module, ds_moe.MoE):
            raise NotImplementedError(
                f"tensor parallelism (AutoTP: tensor_parallel.autotp_size / tp_model_init, "
                f"tp_size={tp_size}) on a model with MoE layers ({name or 'the model'!r} is a "
                "deepspeed.moe.layer.MoE): AutoTP combined with MoE is not implemented in ds; "
                "train the MoE model with expert parallelism (ep_size) over data parallelism, or "
                "use AutoTP on a dense model"
            )


def tp_model_init(
    model: nn.Module,
    tp_size: int,
    dtype: torch.dtype,
    tp_group: Any = None,
    policy: Mapping[str, str] | None = None,
) -> nn.Module:
    """Shard ``model``'s linears over a tensor-parallel group, in place, and return it.

    Args:
        model: an unmodified module (its weights identical on every rank of the group).
        tp_size: ranks in the tensor-parallel group.
        dtype: the model is cast to it first.
        tp_group: the group; None: consecutive blocks of ``tp_size`` ranks of the world.
        policy: ``{name_pattern: "column" | "row" | "skip" | "qkv" | "gate_up"}`` overriding
            the detected split (``qkv``/``gate_up``: a fused projection of 3/2 equal parts, each
            split by itself); a pattern is an ``fnmatch`` glob matched against the full module
            name or its tail.

    Differs from DeepSpeed 0.19, whose ``tp_model_init`` only records its arguments for
    ``initialize()``: here the sharding happens now (see docs/tensor_parallel.md).
    """
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_model_init: tp_size={tp_size!r} must be a positive int")
    if tp_size > 1:
        _refuse_moe(model, tp_size)
    model.to(dtype)
    if tp_size == 1:
        return model
    group = tp_group if tp_group is not None else _default_group(tp_size)
    if ds_comm.get_world_size(group) != tp_size:
        raise ValueError(
            f"tp_model_init: tp_group has {ds_comm.get_world_size(group)} ranks, tp_size={tp_size}"
        )
    tp_rank = ds_comm.get_rank(group)
    plan = _plan(model, policy)
    modules = dict(model.named_modules())
    sections = {
        name: _sections(name, modules[name], choice, modules[name.rpartition(".")[0]])
        for name, choice in plan.items()
    }
    _check_untied(model, plan)
    for name, choice in plan.items():
        _check_divisible(name, modules[name], choice, tp_size, sections[name])
    heads_done: set[str] = set()
    for name, choice in plan.items():
        parent_name, _, leaf = name.rpartition(".")
        parent = modules[parent_name]
        layer = RowParallelLinear if choice == "row" else ColumnParallelLinear
        setattr(parent, leaf, layer(modules[name], group, tp_rank, tp_size, sections[name]))
        if choice != "row" and parent_name not in heads_done:
            heads_done.add(parent_name)
            _divide_heads(parent, parent_name, tp_size)
    return model


def gather_tp_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict of a ``tp_model_init`` model, on every rank of the group.

    Collective over each tensor-parallel group: every rank must call it. Keys are those of the
    original model.
    """
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for name, module in model.named_modules():
        if not is_tensor_parallel_layer(module):
            continue
        prefix = f"{name}." if name else ""
        for pname, param in module.named_parameters(recurse=False):
            if not getattr(param, "tensor_model_parallel", False):
                continue
            dim = param.partition_dim  # type: ignore[attr-defined]
            local = param.detach().contiguous()
            parts = [torch.empty_like(local) for _ in range(module.tp_size)]
            ds_comm.all_gather(parts, local, group=module.group)
            sections = getattr(param, "fused_sections", None)
            state[prefix + pname] = merge_shards(parts, dim, sections)
    return state


def tp_layout(model: nn.Module) -> dict[str, dict[str, Any]]:
    """How each sharded parameter of a ``tp_model_init`` model was split, by state-dict key:
    ``{"dim", "sections", "tp_size"}`` (plain values: checkpoints store it next to the shards so
    :func:`merge_tp_state_dicts` can rebuild the full tensors offline)."""
    layout: dict[str, dict[str, Any]] = {}
    for name, module in model.named_modules():
        if not is_tensor_parallel_layer(module):
            continue
        prefix = f"{name}." if name else ""
        for pname, param in module.named_parameters(recurse=False):
            if getattr(param, "tensor_model_parallel", False):
                sections = getattr(param, "fused_sections", None)
                layout[prefix + pname] = {
                    "dim": int(param.partition_dim),  # type: ignore[attr-defined]
                    "sections": list(sections) if sections is not None else None,
                    "tp_size": module.tp_size,
                }
    return layout


def merge_tp_state_dicts(
    states: Sequence[Mapping[str, torch.Tensor]], layout: Mapping[str, Mapping[str, Any]]
) -> dict[str, torch.Tensor]:
    """One full state dict from every tp rank's (in tp-rank order) and their :func:`tp_layout`;
    unsharded entries come from tp rank 0."""
    sizes = {int(entry["tp_size"]) for entry in layout.values()}
    if sizes and sizes != {len(states)}:
        raise ValueError(
            f"merge_tp_state_dicts: {len(states)} tensor-parallel states, but the layout was "
            f"saved with tp_size {sorted(sizes)}"
        )
    merged = dict(states[0])
    for key, entry in layout.items():
        if key not in merged:
            continue  # e.g. a frozen parameter left out
        sections = entry["sections"]
        parts = [state[key] for state in states]
        merged[key] = merge_shards(parts, int(entry["dim"]), tuple(sections) if sections else None)
    return merged
