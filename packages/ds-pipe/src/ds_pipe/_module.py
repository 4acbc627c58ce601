"""``PipelineModule``: a list of layers split into pipeline stages, each rank building its own.

[Note: virtual stages]
With ``num_virtual_stages = v`` the layers are cut into ``num_stages * v`` contiguous chunks and
stage ``s`` owns chunks ``s, s + num_stages, s + 2 * num_stages, ...`` (interleaved 1F1B: an
activation visits every stage ``v`` times). ``parts`` holds the chunk boundaries; ``forward(x,
chunk_id)`` runs one chunk. With ``v == 1`` the only chunk of stage ``s`` is ``s`` and
``forward(x)`` runs it, as in DeepSpeed.

[Note: tied weights]
Every stage holding a ``TiedLayerSpec`` key builds the module once (seeded, with ``seed_layers``,
as the key's first occurrence is, so untied parameters of the module agree too) and registers it
under ``tied_modules[key]``. For each pipeline replica (each fixed data/model coordinate) the
stages holding the key form a tie group: the tied weights are broadcast from its lowest stage at
construction, their gradients summed over it each step, and only the lowest stage's copy counts
in a global gradient norm (:meth:`PipelineModule.tied_params_owned_elsewhere`). Tie groups are
created on every rank in the order keys first appear in ``layers`` (``new_group`` is
collective and must be called in the same order everywhere).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import ds_comm
from ds_comm import Mpu, ParallelGrid, PipeDataParallelTopology, ProcessGrid, ProcessTopology
from ds_pipe._layer_checkpoint import layer_checkpoint_name, load_layer_state, save_layer_state
from ds_pipe._partition import PartitionMethod, format_partition, layer_name, partition_layers
from ds_pipe._spec import LayerSpec, TiedLayerSpec, get_tied_attr

__all__ = ["PipelineModule", "TiedGroup", "checkpoint_non_reentrant"]


def checkpoint_non_reentrant(function: Callable[..., Any], *args: Any) -> Any:
    """The default ``activation_checkpoint_func``: ``torch.utils.checkpoint`` without reentrancy
    (works when no input requires grad, and with keyword-free tuples of any objects)."""
    return checkpoint(function, *args, use_reentrant=False)


@dataclass
class TiedGroup:
    """One ``TiedLayerSpec`` key as seen from this rank.

    Attributes:
        key: the tie key.
        ranks: global ranks sharing the weights (one per stage holding the key), ascending.
        group: their process group.
        modules: this stage's module(s) for the key (one: every use on a stage shares it).
        weight_attrs: the tied attribute paths, e.g. ``["weight"]``.
    """

    key: str
    ranks: list[int]
    group: Any
    modules: list[nn.Module]
    weight_attrs: list[str]

    def params(self) -> list[nn.Parameter]:
        """The tied parameters on this stage."""
        return [get_tied_attr(m, a) for m in self.modules for a in self.weight_attrs]


class _TiedForward:
    """A later use of a tied module through its ``forward_fn`` (DeepSpeed uses a ``partial``)."""

    def __init__(self, module: nn.Module, forward_fn: Callable[..., Any]) -> None:
        self.module = module
        self.forward_fn = forward_fn

    def __call__(self, *inputs: Any) -> Any:
        return self.forward_fn(self.module, *inputs)


def _seed(seed: int, seed_fn: Callable[[int], Any] | None) -> None:
    if seed_fn is not None:
        seed_fn(seed)
    else:
        random.seed(seed)
        torch.manual_seed(seed)


class PipelineModule(nn.Module):
    """Layers split into pipeline stages; each rank builds and runs only its stage's layers.

    Args:
        layers: ``LayerSpec`` / ``TiedLayerSpec`` entries (built only on the owning stage),
            ``nn.Module`` instances and plain callables (e.g. ``lambda x: x.view(-1, 784)``). Each
            layer gets the previous layer's output as its one argument.
        num_stages: pipeline depth; with ``topology`` None, the data-parallel degree is
            ``world_size // num_stages``.
        topology: a ``ds_comm`` topology with a ``'pipe'`` axis (e.g.
            ``PipeModelDataParallelTopology``); overrides ``num_stages``.
        loss_fn: ``loss_fn(outputs, labels)``, used by the pipeline engine on the last stage.
        seed_layers: seed the RNG with ``base_seed + layer_idx`` before building each layer
            (``seed_fn(seed)`` if given), so weights do not depend on the partition. Unlike
            DeepSpeed, forward passes are not reseeded (DeepSpeed reseeds each layer with an
            offset nothing advances, repeating dropout masks every micro-batch).
        seed_fn: replaces the default seeding (``random.seed`` + ``torch.manual_seed``).
        base_seed: see ``seed_layers``.
        partition_method: ``'parameters'``, ``'uniform'``, ``'type:<regex>'`` or a list of
            ``num_stages * num_virtual_stages + 1`` boundaries (see ``ds_pipe._partition``).
        activation_checkpoint_interval: checkpoint every this many layers (0: off).
        activation_checkpoint_func: ``func(function, *inputs)``; non-reentrant
            ``torch.utils.checkpoint.checkpoint`` by default.
        checkpointable_layers: class names that may be checkpointed (None: any layer range
            holding parameters).
        num_virtual_stages: chunks per stage for interleaved schedules (a ds extension; see
            [Note: virtual stages]).

    Example:
        >>> layers = [LayerSpec(nn.Linear, 784, 128), nn.ReLU(), LayerSpec(nn.Linear, 128, 10)]
        >>> model = PipelineModule(layers, num_stages=2, loss_fn=nn.CrossEntropyLoss())
        >>> model.stage_id, model.parts  # on rank 0 of 2: the big Linear and the ReLU
        (0, [0, 2, 3])
    """

    def __init__(
        self,
        layers: Sequence[Any],
        num_stages: int | None = None,
        topology: ProcessTopology | None = None,
        loss_fn: Callable[..., Any] | None = None,
        seed_layers: bool = False,
        seed_fn: Callable[[int], Any] | None = None,
        base_seed: int = 1234,
        partition_method: PartitionMethod = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable[..., Any] = checkpoint_non_reentrant,
        checkpointable_layers: Sequence[str] | None = None,
        num_virtual_stages: int = 1,
    ) -> None:
        super().__init__()
        if not ds_comm.is_initialized():
            raise RuntimeError(
                "PipelineModule needs an initialised default process group (it builds one "
                "process group per topology axis): call ds_comm.init_distributed() first"
            )
        _check_arguments(layers, activation_checkpoint_interval, num_virtual_stages)
        self.global_rank = ds_comm.get_rank()
        self.world_size = ds_comm.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self._topo = _resolve_topology(num_stages, topology, self.world_size)
        self.num_stages = self._topo.get_dim("pipe")
        self.num_virtual_stages = num_virtual_stages

        self._layer_specs = list(layers)
        self._num_layers = len(self._layer_specs)
        self.loss_fn = loss_fn
        self.seed_layers = seed_layers
        self.seed_fn = seed_fn
        self.base_seed = base_seed
        self.partition_method = partition_method
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = (
            None if checkpointable_layers is None else list(checkpointable_layers)
        )

        # partition before any collective: a bad argument fails every rank alike, no group made
        self.parts = partition_layers(
            self._layer_specs, self.num_stages * num_virtual_stages, partition_method
        )
        self._grid = ProcessGrid(self._topo, group_factory=ds_comm.new_group)
        self._mpu = Mpu(self._grid)
        self.stage_id = self._grid.stage_id
        if self.global_rank == 0:
            print(
                format_partition(
                    self._layer_specs, self.parts, self.num_stages, partition_method, loss_fn
                ),
                flush=True,
            )
        self._local_start = self.parts[self.stage_id]
        self._local_stop = self.parts[self.stage_id + 1]

        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self._chunk_funcs: dict[int, list[Callable[..., Any]]] = {}
        self._local_layer_ids: list[int] = []
        self.forward_funcs: list[Callable[..., Any]] = []
        self._build()
        if ds_comm.is_initialized() and ds_comm.group_device().type != "cpu":
            self.to(ds_comm.group_device())
        self._tied_groups = self._index_tied_modules()
        self._synchronize_tied_weights()

    # --- construction --------------------------------------------------------------------------

    def _first_tied_index(self, key: str) -> int:
        return next(
            i
            for i, s in enumerate(self._layer_specs)
            if isinstance(s, TiedLayerSpec) and s.key == key
        )

    def _build(self) -> None:
        for chunk in self.chunk_ids():
            funcs = self._chunk_funcs[chunk] = []
            for idx in range(self.parts[chunk], self.parts[chunk + 1]):
                funcs.append(self._build_layer(idx, self._layer_specs[idx]))
                self._local_layer_ids.append(idx)
            self.forward_funcs.extend(funcs)

    def _build_layer(self, idx: int, layer: Any) -> Callable[..., Any]:
        if isinstance(layer, TiedLayerSpec):
            if layer.key not in self.tied_modules:
                if self.seed_layers:
                    _seed(self.base_seed + self._first_tied_index(layer.key), self.seed_fn)
                self.tied_modules[layer.key] = layer.build()
                self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
            module = self.tied_modules[layer.key]
            for attr in layer.tied_weight_attr:
                get_tied_attr(module, attr)  # a wrong attribute fails at construction
            return module if layer.forward_fn is None else _TiedForward(module, layer.forward_fn)
        if isinstance(layer, LayerSpec):
            if self.seed_layers:
                _seed(self.base_seed + idx, self.seed_fn)
            module = layer.build()
            self.add_module(str(idx), module)
            return module
        if isinstance(layer, nn.Module):
            self.add_module(str(idx), layer)
        return layer

    def _index_tied_modules(self) -> dict[str, TiedGroup]:
        """Create every tie group on every rank (collective); keep this rank's."""
        keys: list[str] = []
        for spec in self._layer_specs:
            if isinstance(spec, TiedLayerSpec) and spec.key not in keys:
                keys.append(spec.key)
        groups: dict[str, TiedGroup] = {}
        for key in keys:
            stages = sorted(
                {
                    self.stage_owner(i)
                    for i, s in enumerate(self._layer_specs)
                    if isinstance(s, TiedLayerSpec) and s.key == key
                }
            )
            for pipe_ranks in self._topo.get_axis_comm_lists("pipe"):
                ranks = [pipe_ranks[s] for s in stages]
                group = ds_comm.new_group(ranks)
                if self.global_rank in ranks:
                    groups[key] = TiedGroup(
                        key, ranks, group, [self.tied_modules[key]], self.tied_weight_attrs[key]
                    )
                    if self.global_rank != ranks[0]:
                        for param in groups[key].params():
                            param.ds_pipe_replicated = True  # type: ignore[attr-defined]
        return groups

    @torch.no_grad()
    def _synchronize_tied_weights(self) -> None:
        for tied in self._tied_groups.values():
            if len(tied.ranks) > 1:
                for param in tied.params():
                    ds_comm.broadcast(param.data, src=tied.ranks[0], group=tied.group)

    # --- layout --------------------------------------------------------------------------------

    def topology(self) -> ProcessTopology:
        """The rank layout (DeepSpeed: a method)."""
        return self._topo

    @property
    def grid(self) -> ProcessGrid:
        """This rank's process groups per axis (DeepSpeed's axis names)."""
        return self._grid

    @property
    def parallel_grid(self) -> ParallelGrid:
        """The ds-comm ``ParallelGrid`` every group of :attr:`grid` comes from (pp, dp, tp)."""
        return self._grid.parallel_grid

    def mpu(self) -> Mpu:
        """The Megatron-style mpu over the grid (model parallel = the ``'model'`` axis)."""
        return self._mpu

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def chunk_ids(self) -> list[int]:
        """The chunks this stage owns, ascending: ``stage_id + k * num_stages``."""
        return [self.stage_id + k * self.num_stages for k in range(self.num_virtual_stages)]

    def stage_owner(self, layer_idx: int) -> int:
        """The stage that builds and runs global layer ``layer_idx``."""
        if not 0 <= layer_idx < self._num_layers:
            raise ValueError(f"layer_idx={layer_idx} is outside 0..{self._num_layers - 1}")
        chunk = next(c for c in range(len(self.parts) - 1) if layer_idx < self.parts[c + 1])
        return chunk % self.num_stages

    # --- forward -------------------------------------------------------------------------------

    def forward(self, inputs: Any, chunk_id: int | None = None) -> Any:
        """Run this stage's layers of chunk ``chunk_id`` (None: the stage's only chunk).

        Every ``activation_checkpoint_interval`` layers form one checkpointed range when they
        qualify (see :meth:`_is_checkpointable`); checkpointing is skipped under ``no_grad``.
        """
        if chunk_id is None:
            if self.num_virtual_stages != 1:
                raise ValueError(
                    f"stage {self.stage_id} owns chunks {self.chunk_ids()} "
                    f"(num_virtual_stages={self.num_virtual_stages}); pass chunk_id="
                )
            chunk_id = self.stage_id
        if chunk_id not in self._chunk_funcs:
            raise ValueError(
                f"chunk_id={chunk_id} is not on stage {self.stage_id}; it owns {self.chunk_ids()}"
            )
        funcs = self._chunk_funcs[chunk_id]
        interval = self.activation_checkpoint_interval
        if interval == 0 or not torch.is_grad_enabled():
            return self._run_range(funcs, 0, len(funcs))(inputs)
        x = inputs
        for lo in range(0, len(funcs), interval):
            hi = min(lo + interval, len(funcs))
            run = self._run_range(funcs, lo, hi)
            args = x if isinstance(x, tuple) else (x,)
            if self._is_checkpointable(funcs[lo:hi]):
                x = self.activation_checkpoint_func(run, *args)
            else:
                x = run(*args)
        return x

    @staticmethod
    def _run_range(funcs: list[Callable[..., Any]], lo: int, hi: int) -> Callable[..., Any]:
        """``funcs[lo:hi]`` as one function of the unpacked inputs (what checkpointing calls)."""

        def run(*inputs: Any) -> Any:
            x = inputs[0] if len(inputs) == 1 else inputs
            for func in funcs[lo:hi]:
                x = func(x)
            return x

        return run

    def _is_checkpointable(self, funcs: Sequence[Callable[..., Any]]) -> bool:
        """A range is checkpointed when it holds a module with parameters and, with
        ``checkpointable_layers`` given, every module in it is of a listed class.

        Plain callables neither qualify a range nor veto it (DeepSpeed lets a lambda veto).
        """
        modules = [f.module if isinstance(f, _TiedForward) else f for f in funcs]
        modules = [m for m in modules if isinstance(m, nn.Module)]
        if self.checkpointable_layers is not None:
            return bool(modules) and all(
                type(m).__name__ in self.checkpointable_layers for m in modules
            )
        return any(next(m.parameters(), None) is not None for m in modules)

    # --- tied weights --------------------------------------------------------------------------

    def tied_groups(self) -> dict[str, TiedGroup]:
        """Tie key -> this rank's :class:`TiedGroup` (keys this stage holds)."""
        return dict(self._tied_groups)

    @property
    def tied_comms(self) -> dict[str, dict[str, Any]]:
        """DeepSpeed's view of :meth:`tied_groups`: ``{key: {ranks, group, weight_attr, module}}``."""
        return {
            key: {
                "ranks": t.ranks,
                "group": t.group,
                "weight_attr": t.weight_attrs,
                "module": t.modules[0],
            }
            for key, t in self._tied_groups.items()
        }

    def allreduce_tied_weight_gradients(self) -> None:
        """Sum the gradients of each tied weight over its tie group (after backward).

        A tied weight without a gradient contributes zeros, so every member joins the collective.
        """
        for tied in self._tied_groups.values():
            if len(tied.ranks) == 1:
                continue
            for param in tied.params():
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                ds_comm.all_reduce(param.grad, group=tied.group)

    def tied_params_owned_elsewhere(self) -> list[nn.Parameter]:
        """Tied weights held here whose copy on a lower stage is the one a global norm counts."""
        return [
            param
            for tied in self._tied_groups.values()
            if self.global_rank != tied.ranks[0]
            for param in tied.params()
        ]

    # --- per-layer checkpoints -----------------------------------------------------------------

    def ckpt_layer_path(self, ckpt_dir: str | os.PathLike[str], local_layer_idx: int) -> str:
        """The file of this stage's ``local_layer_idx``-th layer (named by its global index)."""
        idx = self._local_layer_ids[local_layer_idx]
        spec = self._layer_specs[idx]
        if isinstance(spec, TiedLayerSpec):
            idx = self._first_tied_index(spec.key)
        rank_repr = self._topo.get_rank_repr(rank=self.global_rank)
        return os.path.join(os.fspath(ckpt_dir), layer_checkpoint_name(idx, rank_repr))

    def _stateful_layers(self) -> list[tuple[int, nn.Module]]:
        """(local index, module) of layers with a checkpoint file; a tied key once."""
        out, seen = [], set()
        for local, func in enumerate(self.forward_funcs):
            module = func.module if isinstance(func, _TiedForward) else func
            if isinstance(module, nn.Module) and id(module) not in seen:
                seen.add(id(module))
                out.append((local, module))
        return out

    def save_state_dict(self, save_dir: str | os.PathLike[str]) -> None:
        """Write ``layer_XX-model_states.pt`` for each of this stage's stateful layers.

        Only data-parallel rank 0 writes (replicas are identical); each model-parallel rank writes
        its own files (``layer_XX-model_YY-model_states.pt``). A tied module is written by the
        stage owning its key's first occurrence. The caller synchronises before reading.
        """
        if self._grid.axis_rank("data") != 0:
            return
        for local, module in self._stateful_layers():
            spec = self._layer_specs[self._local_layer_ids[local]]
            if (
                isinstance(spec, TiedLayerSpec)
                and self.stage_owner(self._first_tied_index(spec.key)) != self.stage_id
            ):
                continue  # a copy of a key first used on another stage, which writes it
            save_layer_state(module, self.ckpt_layer_path(save_dir, local))

    def load_state_dir(self, load_dir: str | os.PathLike[str], strict: bool = True) -> None:
        """Load this stage's layers from per-layer files, whatever stage count saved them."""
        for local, module in self._stateful_layers():
            load_layer_state(module, self.ckpt_layer_path(load_dir, local), strict)

    def extra_repr(self) -> str:
        return (
            f"stage_id={self.stage_id}, num_stages={self.num_stages}, "
            f"layers={self._local_layer_ids[0] if self._local_layer_ids else None}.."
            f"{self._local_layer_ids[-1] if self._local_layer_ids else None}"
        )


def _check_arguments(
    layers: Sequence[Any], activation_checkpoint_interval: int, num_virtual_stages: int
) -> None:
    for idx, layer in enumerate(layers):
        if isinstance(layer, PipelineModule):
            raise TypeError(
                f"layers[{idx}] is a PipelineModule; nesting is not supported: pass its "
                "layers list instead"
            )
        if not (isinstance(layer, (LayerSpec, nn.Module)) or callable(layer)):
            raise TypeError(
                f"layers[{idx}] = {layer!r} ({layer_name(layer)}) is not a LayerSpec, an "
                "nn.Module or a callable"
            )
    if activation_checkpoint_interval < 0:
        raise ValueError(
            f"activation_checkpoint_interval={activation_checkpoint_interval}; use 0 (off) or a "
            "positive number of layers per checkpoint"
        )
    if num_virtual_stages < 1:
        raise ValueError(f"num_virtual_stages={num_virtual_stages}; use 1 or more")


def _resolve_topology(
    num_stages: int | None, topology: ProcessTopology | None, world_size: int
) -> ProcessTopology:
    if topology is not None:
        if "pipe" not in topology.get_axis_names():
            raise ValueError(
                f"{topology!r} has no 'pipe' axis; use PipeDataParallelTopology or "
                "PipeModelDataParallelTopology"
            )
        unknown = [a for a in topology.get_axis_names() if a not in ("pipe", "data", "model")]
        if unknown:
            raise NotImplementedError(
                f"{topology!r}: pipeline axes {unknown} are not implemented in ds; a pipeline "
                "topology has 'pipe', 'data' and 'model' axes (ds_comm.ParallelGrid's pp, dp, tp)"
            )
        pipe = topology.get_dim("pipe")
        if num_stages is not None and num_stages != pipe:
            raise ValueError(
                f"num_stages={num_stages} but the topology has {pipe} pipe stages; pass one of them"
            )
        return topology
    if num_stages is None:
        raise ValueError("PipelineModule needs num_stages or topology; e.g. num_stages=2")
    if num_stages < 1 or world_size % num_stages != 0:
        raise ValueError(
            f"num_stages={num_stages} does not divide the world size {world_size}; use a "
            f"divisor of {world_size} (the rest becomes data parallelism) or pass topology="
        )
    return PipeDataParallelTopology(num_pp=num_stages, num_dp=world_size // num_stages)
