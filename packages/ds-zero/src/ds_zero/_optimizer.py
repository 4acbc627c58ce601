"""``ZeroOptimizer``: a model and any elementwise ``torch.optim`` optimizer, trained with ZeRO
stage 0, 1 or 2 over a data-parallel group: the step core (``_core.py``, [Note: one step]) set
up with the flat-bucket layout (``_flat_layout.py``) and whole parameters (``_residency.py``).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from ds_zero._core import GradientCore
from ds_zero._flat_layout import FlatLayout
from ds_zero._layout import FlatGroup
from ds_zero._manifest import shard_destinations
from ds_zero._param_access import register_param_owner
from ds_zero._residency import WholeResidency
from ds_zero._setup import check_step_options
from ds_zero._shards import ShardLookup, TensorShard
from ds_zero.api import MemoryBreakdown, TensorSwapper, ZeroConfig

__all__ = ["ZeroOptimizer"]


class ZeroOptimizer(GradientCore):
    """ZeRO stage 0/1/2 around ``model`` and ``optimizer`` over a data-parallel group.

    The model's trainable parameters become views into flat per-group buffers, the optimizer's
    param groups are re-pointed at flat fp32 master partitions (their hyper-parameters, and any
    LR scheduler holding the optimizer, keep working), and the initial parameters are broadcast
    from the group's first rank. It is the step core (``_core.py``, [Note: one step]) with the
    flat-bucket layout (:class:`~ds_zero._flat_layout.FlatLayout`) and whole parameters.

    Args:
        model: the module (its parameters in one dtype: fp32, bf16 or fp16, on one device).
        optimizer: a ``torch.optim`` optimizer over the model's trainable parameters, without
            state yet; with ``offload_optimizer`` ds-optim's ``CPUAdam`` is the fast choice.
        config: the ``zero_optimization`` section (default: stage 0).
        group: the data-parallel process group (None: the default group, or a single process
            when ``torch.distributed`` is not initialised).
        loss_scaler: ds-optim's ``DynamicLossScaler``/``StaticLossScaler`` for fp16 (anything
            with ``loss_scale``, ``update_scale(overflow)``, ``state_dict``/``load_state_dict``).
        gradient_accumulation_steps: micro-batches per optimizer step; ``backward`` divides the
            loss by it.
        gradient_clipping: max global gradient norm (0: no clipping).
        swapper: where optimizer state goes with ``offload_optimizer.device="nvme"``
            (default: ds-offload-aio's ``AsyncTensorSwapper`` with default ``aio`` settings).
        param_group_process_groups: one entry per optimizer param group: the process group
            that group is reduced and sharded over, a subgroup of ``group`` (None: ``group``).
            MoE expert groups pass their expert-data-parallel group; gradients are still
            divided by ``group``'s size (see [Note: param groups with their own process group]).
        gradient_predivide_factor: DeepSpeed's key: gradients are divided by it before the sum
            and the sum multiplied by ``factor / world_size`` after it (None: the world size,
            i.e. all of the averaging before the sum, as DeepSpeed's ``prescale_gradients``).
        communication_data_type: dtype the gradient collectives run in (``torch.float32``,
            ``float16``, ``bfloat16`` or DeepSpeed's ``"fp32"``/``"fp16"``/``"bf16"``; None: the
            gradients' dtype); the result is cast back into the gradient storage.
        norm_group: a further process group over which the squared gradient norm is summed:
            the pipeline (or model-parallel) group, whose ranks hold different parameters, so
            that clipping and overflow skips use the norm of the whole model on every rank.
        norm_exclude: parameters left out of this rank's share of the norm because another
            rank of ``norm_group`` counts them (a pipeline's tied embedding held by two stages).

    Example:
        >>> zero = ZeroOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
        ...                      ZeroConfig(stage=2, overlap_comm=True), group=dp_group)
        >>> for batch in loader:
        ...     zero.backward(loss_fn(model(batch)))
        ...     zero.step()
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        config: ZeroConfig | None = None,
        *,
        group: Any = None,
        loss_scaler: Any = None,
        gradient_accumulation_steps: int = 1,
        gradient_clipping: float = 0.0,
        swapper: TensorSwapper | None = None,
        param_group_process_groups: Sequence[Any] | None = None,
        gradient_predivide_factor: float | None = None,
        communication_data_type: torch.dtype | str | None = None,
        norm_group: Any = None,
        norm_exclude: Sequence[torch.nn.Parameter] = (),
    ) -> None:
        config = config if config is not None else ZeroConfig()
        comm_dtype = check_step_options(
            gradient_accumulation_steps,
            gradient_clipping,
            gradient_predivide_factor,
            communication_data_type,
        )
        residency = WholeResidency()
        layout = FlatLayout(
            model,
            optimizer,
            config,
            residency,
            group=group,
            swapper=swapper,
            param_group_process_groups=param_group_process_groups,
            gradient_predivide_factor=gradient_predivide_factor,
            comm_dtype=comm_dtype,
            norm_group=norm_group,
            norm_exclude=norm_exclude,
        )
        super().__init__(
            layout,
            residency,
            optimizer=optimizer,
            loss_scaler=loss_scaler,
            gradient_accumulation_steps=gradient_accumulation_steps,
            gradient_clipping=gradient_clipping,
        )
        self.layout: FlatLayout = layout
        # the layout's attributes, under the names this class has always had
        self.config = config
        self.module = model
        self.group = group
        self.rank = layout.rank
        self.world_size = layout.world_size
        self.num_shards = layout.num_shards
        self.shard_rank = layout.shard_rank  # whose slice of each unit
        self.own_groups = layout.own_groups
        self.groups: list[FlatGroup] = layout.groups
        self.norm_group = layout.norm_group
        self.masters: list[torch.Tensor] = layout.masters
        self._swap = layout._swap
        register_param_owner(layout, layout.params)

    # --- the layout's state, checkpoint shards and memory ----------------------------------------

    def refresh_fp32_params(self, exclude: Collection[str] = ()) -> None:
        """Rebuild the fp32 master partitions from the model's parameters (DeepSpeed's name),
        e.g. after loading module weights without optimizer state; those of the parameters
        named in ``exclude`` are left as they are (a load wrote them, see
        :meth:`master_views`)."""
        self.layout.refresh_fp32_params(exclude)

    def master_views(self) -> dict[str, torch.Tensor]:
        """Each trainable parameter this rank's fp32 master partition holds whole, by name, as
        a view of the master shaped like the parameter (empty where the masters are not
        separate fp32 memory on the CPU). A weights-only load may write the weights there and
        copy them into the parameters, then :meth:`refresh_fp32_params` with these names
        excluded: one copy fewer. If the load fails after writing them,
        ``refresh_fp32_params()`` puts the masters back from the unchanged parameters."""
        return self.layout.master_views()

    def params_from_masters(self) -> list[torch.nn.Parameter]:
        """The parameters a sharded load (:meth:`load_checkpoint_shards`,
        :meth:`load_state_dict`) sets from the saved fp32 masters: every trainable one with
        ``load_from_fp32_weights``, none without (the masters are then rebuilt from the
        parameters, which must be loaded first). A loader need not read their weights from
        anywhere else."""
        if not self.config.load_from_fp32_weights:
            return []
        return [p for group in self.groups for p in group.params]

    def state_dict(self) -> dict[str, Any]:
        """This rank's sharded state: its master partition, optimizer state and the layout.

        Save it per rank (or use :func:`~ds_zero.save_sharded_checkpoint`); the list of every
        rank's state loads on any world size (see [Note: resharding a checkpoint]).
        """
        return {**self.layout.state_dict(), **self._core_state()}

    def load_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Restore from this rank's :meth:`state_dict`, or from every saved rank's (any world
        size, with ``elastic_checkpoint``).

        With ``load_from_fp32_weights`` the model's parameters are rebuilt from the saved fp32
        masters; otherwise the masters are rebuilt from the model's current parameters (load the
        model's weights first).
        """
        self._load_core_state(self.layout.load_state_dict(state))

    def checkpoint_shards(self) -> list[TensorShard]:
        """What this rank holds, per parameter range, for a universal checkpoint (see
        [Note: tensor shards of the flat layout])."""
        return self.layout.checkpoint_shards()

    def shard_destinations(
        self, folder: str | os.PathLike[str]
    ) -> dict[str, dict[str, torch.Tensor]]:
        """Where a full load of the sharded checkpoint in ``folder`` may have the checksum
        threads copy this rank's pieces as they hash them: per shard file (relative to
        ``folder``), per tensor key, a range of a new buffer the next
        :meth:`load_checkpoint_shards` takes as its optimizer state (or, for the masters, copies
        from) instead of copying each range out of the file (see ds-zero's [Note: copying the
        pieces into the optimizer's buffers]). Empty where the checkpoint's pieces are not
        exactly this rank's ranges (another world size or layout), or its manifest cannot be
        read (the load's verification says why)."""
        return shard_destinations(folder, self.layout)

    def load_checkpoint_shards(self, lookup: ShardLookup) -> None:
        """Fill this rank's masters, optimizer state and parameters from ``lookup`` (a
        checkpoint of any world size or stage)."""
        self.layout.load_checkpoint_shards(lookup)

    def memory_breakdown(self) -> MemoryBreakdown:
        """Bytes this rank holds for parameters, gradients and optimizer state right now.

        Example:
            >>> zero.memory_breakdown().model_states  # params + grads + optimizer state
        """
        return self.layout.memory_breakdown()
