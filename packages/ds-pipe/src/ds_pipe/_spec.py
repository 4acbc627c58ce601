"""Deferred layer construction: :class:`LayerSpec` and :class:`TiedLayerSpec`.

A spec records a layer's class and constructor arguments so that
:class:`~ds_pipe.PipelineModule` builds each layer only on the stage that owns it; the other
stages never allocate its weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["LayerSpec", "TiedLayerSpec", "get_tied_attr"]


def _call_repr(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> str:
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{name}({', '.join(parts)})"


class LayerSpec:
    """A layer to build later: ``typename(*module_args, **module_kwargs)``.

    Args:
        typename: a ``torch.nn.Module`` subclass.
        *module_args: positional constructor arguments.
        **module_kwargs: keyword constructor arguments.

    Example:
        >>> spec = LayerSpec(torch.nn.Linear, 784, 128, bias=False)
        >>> layer = spec.build()  # torch.nn.Linear(784, 128, bias=False)
    """

    def __init__(self, typename: type[nn.Module], *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(
                f"LayerSpec needs a torch.nn.Module subclass, got {typename!r}; wrap functions "
                "in an nn.Module or pass the callable itself in `layers` (it has no weights)"
            )
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self, log: bool = False) -> nn.Module:
        """Construct the layer (on the current default device)."""
        if log:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else -1
            print(f"RANK={rank} building {self!r}", flush=True)
        return self.typename(*self.module_args, **self.module_kwargs)

    @property
    def name(self) -> str:
        """The class name of the layer (what ``type:<regex>`` partitioning matches)."""
        return self.typename.__name__

    def __repr__(self) -> str:
        return _call_repr(self.name, self.module_args, self.module_kwargs)


class TiedLayerSpec(LayerSpec):
    """A layer whose weights are shared by every spec with the same ``key``, across stages.

    The first use of ``key`` on a stage builds the module; later uses on that stage reuse it.
    Stages holding the same key keep identical copies: the weights are broadcast from the lowest
    stage at construction and their gradients summed over the tie group each step
    (:meth:`PipelineModule.allreduce_tied_weight_gradients`).

    Args:
        key: the name that ties specs together.
        typename: a ``torch.nn.Module`` subclass.
        *module_args: positional constructor arguments.
        forward_fn: ``forward_fn(module, *inputs)`` used instead of ``module(*inputs)``, e.g. the
            unembedding ``lambda module, x: x @ module.weight.t()``.
        tied_weight_attr: attribute name(s), dotted paths allowed, of the shared parameters.
        **module_kwargs: keyword constructor arguments.

    Example:
        >>> embed = TiedLayerSpec("embed", torch.nn.Embedding, 1000, 64)
        >>> unembed = TiedLayerSpec(
        ...     "embed", torch.nn.Embedding, 1000, 64, forward_fn=lambda m, x: x @ m.weight.t()
        ... )
    """

    def __init__(
        self,
        key: str,
        typename: type[nn.Module],
        *module_args: Any,
        forward_fn: Callable[..., Any] | None = None,
        tied_weight_attr: str | Sequence[str] = "weight",
        **module_kwargs: Any,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        if not isinstance(key, str) or not key:
            raise ValueError(f"TiedLayerSpec key must be a non-empty str, got {key!r}")
        self.key = key
        self.forward_fn = forward_fn
        attrs = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)
        if not attrs:
            raise ValueError(f"TiedLayerSpec {key!r}: tied_weight_attr is empty; name a parameter")
        self.tied_weight_attr: list[str] = attrs

    def __repr__(self) -> str:
        return f"Tied[{self.key}]:{super().__repr__()}"


def get_tied_attr(module: nn.Module, attr: str) -> nn.Parameter:
    """The parameter at ``attr`` (a dotted path such as ``"proj.weight"``) of ``module``."""
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise AttributeError(
                f"tied_weight_attr {attr!r}: {type(module).__name__} has no attribute {part!r}; "
                "name one of its parameters, e.g. 'weight'"
            )
        obj = getattr(obj, part)
    if not isinstance(obj, torch.Tensor):
        raise TypeError(f"tied_weight_attr {attr!r} is a {type(obj).__name__}, not a parameter")
    return obj  # type: ignore[return-value]
