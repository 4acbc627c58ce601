"""Splitting a list of layers into contiguous pipeline parts.

``partition_layers`` turns a ``partition_method`` into boundaries ``parts`` (``len == num_parts +
1``, part ``i`` holds layers ``parts[i]:parts[i + 1]``):

- ``"parameters"``: balance trainable parameter counts (counted on the meta device, so no weights
  are allocated; see [Note: counting parameters without building]).
- ``"uniform"``: balance layer counts.
- ``"type:<regex>"``: balance the number of layers whose class name matches ``regex``
  (case-insensitive), e.g. ``"type:transformer"``.
- a list of ``num_parts + 1`` increasing boundaries from 0 to the number of layers.

[Note: counting parameters without building]
DeepSpeed builds every layer on every rank to count its parameters, which materialises the whole
model on each stage. ds-pipe builds each :class:`LayerSpec` under ``torch.device("meta")``: the
constructor runs, but tensors have shapes and no storage, and the CPU random generator is not
advanced. A constructor that cannot run on meta (it reads tensor values) is built for real on the
CPU, counted and dropped.
"""

from __future__ import annotations

import bisect
import itertools
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ds_pipe._spec import LayerSpec

__all__ = [
    "count_layer_params",
    "format_partition",
    "layer_name",
    "partition_balanced",
    "partition_layers",
    "partition_uniform",
]

PartitionMethod = str | Sequence[int]


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries splitting ``num_items`` into ``num_parts`` parts whose sizes differ by at most 1.

    The first ``num_items % num_parts`` parts get the extra item (DeepSpeed's order).

    Example:
        >>> partition_uniform(7, 3)
        [0, 3, 5, 7]
    """
    _check_num_parts(num_items, num_parts)
    size, extra = divmod(num_items, num_parts)
    parts = [0]
    for p in range(num_parts):
        parts.append(parts[-1] + size + (1 if p < extra else 0))
    return parts


def _check_num_parts(num_items: int, num_parts: int) -> None:
    if num_parts < 1:
        raise ValueError(f"num_parts={num_parts}; a partition needs at least one part")
    if num_items < num_parts:
        raise ValueError(
            f"{num_items} layers cannot fill {num_parts} pipeline parts (stages x virtual "
            f"stages); every part needs a layer: use at most {num_items} parts or add layers"
        )


def _parts_needed(prefix: list[int], start: int, cap: int) -> int:
    """Fewest contiguous parts covering items ``start:`` with each part's weight <= ``cap``."""
    n = len(prefix) - 1
    count = 0
    while start < n:
        # furthest end with prefix[end] - prefix[start] <= cap; at least one item per part
        end = bisect.bisect_right(prefix, prefix[start] + cap, lo=start + 1) - 1
        start = max(end, start + 1)
        count += 1
    return count


def partition_balanced(weights: Sequence[int], num_parts: int) -> list[int]:
    """Boundaries of ``num_parts`` non-empty contiguous parts minimising the heaviest part.

    Among partitions with the smallest bottleneck, each part in turn ends where its weight comes
    closest to an even share of what is left, so the slack is spread rather than left to the last
    part.

    Example:
        >>> partition_balanced([4, 1, 1, 1, 1], 2)
        [0, 1, 5]
    """
    n = len(weights)
    _check_num_parts(n, num_parts)
    if any(int(w) < 0 for w in weights):
        raise ValueError(f"partition weights must be >= 0, got {list(weights)}")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + int(w))
    lo, hi = max(int(w) for w in weights), prefix[-1]
    while lo < hi:  # smallest bottleneck that num_parts parts can meet
        mid = (lo + hi) // 2
        if _parts_needed(prefix, 0, mid) <= num_parts:
            hi = mid
        else:
            lo = mid + 1
    cap = lo
    parts = [0]
    for k in range(num_parts - 1):
        start, left = parts[-1], num_parts - k - 1  # parts still to fill after this one
        share = (prefix[-1] - prefix[start]) / (num_parts - k)
        best = None
        for end in range(start + 1, n - left + 1):
            weight = prefix[end] - prefix[start]
            if weight > cap:
                break
            if _parts_needed(prefix, end, cap) > left:
                continue  # the rest would not fit under the bottleneck
            # ties go to the longer part (front-loads like partition_uniform)
            if best is None or abs(weight - share) <= abs(prefix[best] - prefix[start] - share):
                best = end
        assert best is not None, "the bottleneck search guarantees a feasible end"
        parts.append(best)
    parts.append(n)
    return parts


def layer_name(layer: Any) -> str:
    """The class name ``type:<regex>`` matches: the built class of a spec, a module's class, or a
    callable's ``__name__``."""
    if isinstance(layer, LayerSpec):
        return layer.name
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", type(layer).__name__)


def count_layer_params(layer: Any) -> int:
    """Trainable parameter count of one entry of ``layers`` without allocating its weights.

    See [Note: counting parameters without building]. Plain callables count 0.
    """
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad)
    if not isinstance(layer, LayerSpec):
        return 0
    try:
        with torch.device("meta"):
            module = layer.build()
    except Exception:  # a constructor that reads tensor values: build it for real
        module = layer.build()
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def _method_weights(layers: Sequence[Any], method: str) -> list[int] | None:
    """Per-layer weights for a named method; None for ``uniform``."""
    lowered = method.lower()
    if lowered == "uniform":
        return None
    if lowered == "parameters":
        return [count_layer_params(layer) for layer in layers]
    if lowered.startswith("type:"):
        pattern = method[len("type:") :]
        try:
            regex = re.compile(pattern, re.IGNORECASE)
        except re.error as exc:
            raise ValueError(
                f"partition_method={method!r}: {pattern!r} is not a valid regex ({exc})"
            ) from exc
        weights = [1 if regex.search(layer_name(layer)) else 0 for layer in layers]
        if not any(weights):
            names = sorted({layer_name(layer) for layer in layers})
            raise ValueError(
                f"partition_method={method!r} matches no layer class; the classes are {names}"
            )
        return weights
    raise ValueError(
        f"partition_method={method!r} is not supported; use 'parameters', 'uniform', "
        "'type:<regex>' (e.g. 'type:transformer') or a list of boundaries"
    )


def _check_explicit(parts: Sequence[int], num_layers: int, num_parts: int) -> list[int]:
    bounds = [int(b) for b in parts]
    ok = (
        len(bounds) == num_parts + 1
        and bounds[0] == 0
        and bounds[-1] == num_layers
        and all(a < b for a, b in itertools.pairwise(bounds))
    )
    if not ok:
        raise ValueError(
            f"partition_method={list(parts)} is not a valid list of boundaries: give "
            f"{num_parts + 1} strictly increasing integers from 0 to {num_layers} (one part per "
            f"stage x virtual stage), e.g. {partition_uniform(num_layers, num_parts)}"
        )
    return bounds


def partition_layers(
    layers: Sequence[Any], num_parts: int, method: PartitionMethod = "parameters"
) -> list[int]:
    """Boundaries of ``num_parts`` contiguous parts of ``layers`` by ``method``.

    Example:
        >>> partition_layers([LayerSpec(nn.Linear, 4, 4)] * 4, 2, "uniform")
        [0, 2, 4]
    """
    _check_num_parts(len(layers), num_parts)
    if not isinstance(method, str):
        return _check_explicit(method, len(layers), num_parts)
    weights = _method_weights(layers, method)
    if weights is None or not any(weights):
        return partition_uniform(len(layers), num_parts)
    return partition_balanced(weights, num_parts)


def format_partition(
    layers: Sequence[Any],
    parts: Sequence[int],
    num_stages: int,
    method: PartitionMethod,
    loss_fn: Callable[..., Any] | None = None,
) -> str:
    """The partition as a table: one row per layer with its stage, chunk and parameter count."""
    counts = [count_layer_params(layer) for layer in layers]
    num_chunks = len(parts) - 1
    header = (
        f"Pipeline partition: {len(layers)} layers on {num_stages} stages"
        + (f" x {num_chunks // num_stages} virtual stages" if num_chunks > num_stages else "")
        + f", method={method!r}, {sum(counts):,} trainable params"
    )
    rows = [("stage", "chunk", "layer", "params", "spec")]
    for chunk in range(num_chunks):
        for idx in range(parts[chunk], parts[chunk + 1]):
            rows.append(
                (
                    str(chunk % num_stages),
                    str(chunk),
                    str(idx),
                    f"{counts[idx]:,}",
                    _describe(layers[idx]),
                )
            )
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [header]
    for row in rows:
        cells = [row[i].rjust(widths[i]) for i in range(4)]
        lines.append("  ".join([*cells, row[4]]))
    totals = ", ".join(
        f"stage {s}: {sum(counts[i] for c in range(s, num_chunks, num_stages) for i in range(parts[c], parts[c + 1])):,}"
        for s in range(num_stages)
    )
    lines.append(f"params per stage: {totals}")
    if loss_fn is not None:
        lines.append(f"loss: {getattr(loss_fn, '__name__', type(loss_fn).__name__)}")
    return "\n".join(lines)


def _describe(layer: Any) -> str:
    if isinstance(layer, LayerSpec):
        return repr(layer)
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return f"callable {layer_name(layer)}"
