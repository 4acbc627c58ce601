"""Parameter residency: where the model's parameters live between their uses, one of the two
strategies of the gradient-step core (``_core.py``, [Note: one step]).

[Note: parameter residency]
A residency answers what the step core asks about parameters, never about gradients:

- ``end_iteration()``: after every backward (also a failed one);
- ``release(p)``: ``p``'s gradient was taken (its reduction is queued): the parameter may go;
- ``before_publish()`` / ``after_publish(params)``: around the layout's write of the stepped
  masters into the parameters;
- ``remove()``: the optimizer is destroyed;
- ``working_bytes``: the peak of gathered parameters (memory accounting).

:class:`WholeResidency` (stages 0-2): every rank holds every parameter whole, so all of it is
a no-op. :class:`PartitionedResidency` (stage 3, ``ZeroConfig.shard_parameters``): each rank
holds a shard (``_partitioned.py``); :class:`~ds_zero._stage3.Stage3Hooks` gather a module's
parameters around its forward and backward and release them after, and prefetch along the
trace that ``end_iteration`` closes; a parameter is released again once its gradient is taken;
ZeRO++ hpZ's secondary copies are dropped before a publish (they hold the old values) and the
persistent parameters (``stage3_param_persistence_threshold``) are gathered whole after it.
"""

# DeepSpeed's ZeRO-3 parameter attributes (p.ds_persist, ...) are set on torch Parameters at
# run time, which the type checker cannot see.
# pyright: reportAttributeAccessIssue=false

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from ds_zero._partitioned import ParamPartitioner
from ds_zero._stage3 import PrefetchStats, Stage3Hooks
from ds_zero._zeropp import build_weight_comm
from ds_zero.api import ZeroConfig

__all__ = ["PartitionedResidency", "Residency", "WholeResidency"]


class Residency(Protocol):
    """Where parameters live between uses (see [Note: parameter residency])."""

    def end_iteration(self) -> None:
        """After every backward (also a failed one)."""
        ...

    def release(self, param: torch.nn.Parameter) -> None:
        """``param``'s gradient was taken: it is not needed until its next use."""
        ...

    def before_publish(self) -> None:
        """The masters are about to be written into the parameters."""
        ...

    def after_publish(self, params: Iterable[torch.nn.Parameter]) -> None:
        """The masters of ``params`` were written into them."""
        ...

    def remove(self) -> None:
        """Remove whatever the residency installed on the model."""
        ...

    @property
    def working_bytes(self) -> int:
        """Peak bytes of parameters gathered beyond what this rank holds."""
        ...


class WholeResidency:
    """Every rank holds every parameter whole (stages 0-2): nothing to gather or release."""

    def end_iteration(self) -> None:
        """Nothing to end."""

    def release(self, param: torch.nn.Parameter) -> None:
        """Kept: the parameter is this rank's."""
        del param

    def before_publish(self) -> None:
        """Nothing to drop."""

    def after_publish(self, params: Iterable[torch.nn.Parameter]) -> None:
        """The publish wrote the parameters whole already."""
        del params

    def remove(self) -> None:
        """Nothing installed."""

    @property
    def working_bytes(self) -> int:
        """Nothing is gathered."""
        return 0


class PartitionedResidency:
    """Each rank holds a shard of every parameter; module hooks gather and release them (stage
    3, see [Note: parameter residency]).

    Args:
        model: the module, its parameters partitioned by ``partitioner`` already.
        partitioner: the partitioner of the model's parameters.
        config: the ``zero_optimization`` section (prefetch and ZeRO++ settings).
        group: the group the parameters are partitioned over (ZeRO++ hpZ's secondary group is
            carved from it).
        world_size: that group's size.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        partitioner: ParamPartitioner,
        config: ZeroConfig,
        *,
        group: object,
        world_size: int,
    ) -> None:
        self.partitioner = partitioner
        # ZeRO++ qwZ/hpZ: how the hooks' gathers travel (_zeropp.py's [Note: ZeRO++])
        partitioner.weight_comm = build_weight_comm(config, group, world_size)
        self.hooks = Stage3Hooks(
            model,
            partitioner,
            prefetch_bucket_size=config.stage3_prefetch_bucket_size,
            max_live_parameters=config.stage3_max_live_parameters,
            max_reuse_distance=config.stage3_max_reuse_distance,
        )

    @property
    def stats(self) -> PrefetchStats:
        """Prefetch hits, misses and trace invalidations so far."""
        return self.hooks.stats

    def end_iteration(self) -> None:
        """End the prefetch trace of this forward/backward."""
        self.hooks.end_iteration()

    def release(self, param: torch.nn.Parameter) -> None:
        """Free ``param``'s gathered storage (its gradient hook fired)."""
        self.partitioner.release([param], free_storage=True)

    def before_publish(self) -> None:
        """ZeRO++ hpZ: the secondary copies hold the old values."""
        self.partitioner.drop_secondary()

    def after_publish(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Gather the persistent ones among ``params`` whole again."""
        self.partitioner.write_full_from_shards([p for p in params if p.ds_persist])

    def remove(self) -> None:
        """Remove the module hooks (the parameters stay partitioned)."""
        self.hooks.remove()

    @property
    def working_bytes(self) -> int:
        """The peak gathered working set so far."""
        params = self.partitioner.params
        itemsize = params[0].element_size() if params else 0
        return self.partitioner.peak_gathered_numel * itemsize
