"""Move a ZeRO optimizer's training state off the compute device between training phases and
back (DeepSpeed's ``offload_states`` / ``reload_states``, which RLHF loops call around
generation).

[Note: relocating storages, not tensors]
The optimizer, the model and the caller hold the state through many tensor objects that share a
few storages: the model's parameters are views into a flat buffer (stages 0-2), their ``.grad``
views into the flat gradient buffer, the optimizer's state dict is keyed by the master tensors,
and a stage 0 fp32 master *is* the flat parameter buffer. Moving one tensor (``t.to("cpu")``)
would break every alias, and the old storage would stay alive through the others. So the unit
moved is a *storage*: its bytes are copied into one new host buffer (page-locked through the
accelerator when ``pin_memory``), and every tensor that views it is re-pointed (``t.data =``)
at the same offset, sizes and strides of the new storage. Identities, view relations and the
optimizer's state keys all survive, the old storage loses its last reference and is freed, and
``reload_states`` does the same in the other direction. Values are copied bit for bit, so
training after a reload continues exactly as if nothing had moved.

Which storages move is decided per state kind (``OffloadStateTypeEnum``) from the optimizer's
own tensors (:func:`state_tensors`); which tensors view them is found among those tensors and
every live Python tensor (``gc``): aliases the optimizer does not know about (a caller's
``p.data`` taken earlier) are re-pointed too, so nothing is left reading a stale copy. Kinds
that share a storage move together (a stage 0 fp32 master is the parameter buffer itself).
Storages already off the compute device (``offload_optimizer``'s host masters and state) and
empty ones (stage 3's released gather buffers) are left where they are.

While offloaded the model still works, slowly: its parameters are host tensors. DeepSpeed
instead empties them; ds keeps the values reachable so an evaluation between phases does not
crash, and ``reload_states`` puts everything back before training resumes.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ds_comm.accelerator import get_accelerator
from ds_zero.api import OffloadStateTypeEnum

__all__ = [
    "offload_states",
    "offloaded_states",
    "reload_states",
    "resident_state_bytes",
    "state_tensors",
]

_Kind = OffloadStateTypeEnum


@dataclass(eq=False)
class _Moved:
    """One storage moved to host: the host copy and where it came from."""

    host: torch.UntypedStorage
    device: torch.device
    kinds: set[_Kind]


@dataclass(eq=False)
class _OffloadRecord:
    """What is offloaded for one optimizer."""

    moved: list[_Moved] = field(default_factory=list)
    kinds: set[_Kind] = field(default_factory=set)


_RECORDS: weakref.WeakKeyDictionary[Any, _OffloadRecord] = weakref.WeakKeyDictionary()


# --- which tensors are which state ---------------------------------------------------------------


def _tensors(values: Iterable[Any]) -> list[torch.Tensor]:
    return [v for v in values if isinstance(v, torch.Tensor)]


def _trainable(optimizer: Any) -> list[torch.nn.Parameter]:
    module = getattr(optimizer, "module", None)
    if module is None:
        return [p for g in optimizer.optimizer.param_groups for p in g["params"]]
    return [p for p in module.parameters() if p.requires_grad]


def state_tensors(optimizer: Any) -> dict[OffloadStateTypeEnum, list[torch.Tensor]]:
    """The tensors of each state kind ``optimizer`` holds (a ds-zero gradient step: stage 0-3's
    ``ZeroOptimizer``/``Stage3Optimizer`` or a ``SelfReducingStep``).

    Example:
        >>> sum(t.nbytes for t in state_tensors(zero)[OffloadStateTypeEnum.hp_params])
    """
    inner = optimizer.optimizer
    params = _trainable(optimizer)
    reducer = getattr(optimizer, "reducer", None)
    found: dict[_Kind, list[torch.Tensor]] = {kind: [] for kind in _Kind}
    found[_Kind.optim_states] = _tensors(v for s in inner.state.values() for v in s.values())
    found[_Kind.hp_params] = _tensors(getattr(optimizer, "masters", ()))
    lp = found[_Kind.lp_params]
    lp += _tensors(getattr(g, "flat", None) for g in getattr(optimizer, "groups", ()))
    lp += params
    lp += _tensors(getattr(p, "ds_tensor", None) for p in params)
    grads = found[_Kind.lp_grads]
    grads += _tensors(p.grad for p in params)
    if reducer is not None:
        grads += _tensors((*getattr(reducer, "full", ()), *getattr(reducer, "part", ())))
        grads += _tensors(getattr(reducer, "grad_shards", ()))
        staging = getattr(reducer, "_staging", None)
        if staging is not None:
            found[_Kind.contiguous_grad_buffer] = _tensors(
                (*staging.free, *staging._bases.values())
            )
    return found


# --- relocating storages (see [Note: relocating storages, not tensors]) ---------------------------


def _key(t: torch.Tensor) -> tuple[torch.device, int] | None:
    """The storage ``t`` views, as (device, address); None for one that holds no bytes."""
    if t.layout != torch.strided or t.device.type == "meta":
        return None
    storage = t.untyped_storage()
    if storage.nbytes() == 0:
        return None
    return t.device, storage.data_ptr()


def _with_bases(tensors: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    for t in tensors:
        yield t
        if t._base is not None:
            yield t._base


def _gc_tensors() -> Iterator[torch.Tensor]:
    """Every live plain tensor the garbage collector tracks."""
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, torch.nn.Parameter):
            yield obj


def _aliases(
    keys: Iterable[tuple[torch.device, int]], tensors: Iterable[torch.Tensor]
) -> dict[tuple[torch.device, int], list[torch.Tensor]]:
    """The tensors among ``tensors`` viewing each storage in ``keys`` (each object once)."""
    by_key: dict[tuple[torch.device, int], list[torch.Tensor]] = {k: [] for k in keys}
    seen: set[int] = set()
    for t in tensors:
        if id(t) in seen:
            continue
        seen.add(id(t))
        try:
            key = _key(t)
        except (RuntimeError, NotImplementedError):  # a tensor without a plain storage
            continue
        if key in by_key:
            by_key[key].append(t)
    return by_key


def _relocate(
    sources: dict[tuple[torch.device, int], torch.UntypedStorage],
    known: list[torch.Tensor],
    make: Callable[[torch.UntypedStorage], torch.UntypedStorage],
    non_blocking: bool,
) -> dict[tuple[torch.device, int], torch.UntypedStorage]:
    """Copy each storage in ``sources`` into ``make(source)`` and re-point its views; returns
    the new storages by the old keys. The views are found among ``known`` first; a storage
    still alive after that has views the optimizer does not list, and the live tensors are
    searched for them (see [Note: relocating storages, not tensors])."""
    made: dict[tuple[torch.device, int], torch.UntypedStorage] = {}
    for key, source in sources.items():
        made[key] = make(source)
        made[key].copy_(source, non_blocking=non_blocking)
        del source
    alive = {key: weakref.ref(source) for key, source in sources.items()}
    sources.clear()  # the old storages must lose every reference held here
    for key, views in _aliases(alive, _with_bases(known)).items():
        _repoint(views, made[key])
    survivors = [key for key, ref in alive.items() if ref() is not None]
    if survivors:
        for key, views in _aliases(survivors, _gc_tensors()).items():
            _repoint(views, made[key])
    return made


def _repoint(views: list[torch.Tensor], storage: torch.UntypedStorage) -> None:
    """Point every tensor in ``views`` at the same place in ``storage``."""
    for t in views:
        placed = torch.empty(0, dtype=t.dtype, device=storage.device)
        placed.set_(storage, t.storage_offset(), t.size(), t.stride())
        t.data = placed


def _storage_of(key: tuple[torch.device, int], known: list[torch.Tensor]) -> torch.UntypedStorage:
    return next(t.untyped_storage() for t in _with_bases(known) if _key(t) == key)


def _host_storage(nbytes: int, pin_memory: bool) -> torch.UntypedStorage:
    if pin_memory:
        return get_accelerator().pin_empty(nbytes, dtype=torch.uint8).untyped_storage()
    return torch.empty(nbytes, dtype=torch.uint8).untyped_storage()


def _compute_device() -> torch.device:
    return torch.device(get_accelerator().current_device_name())


def _resident(key: tuple[torch.device, int], record: _OffloadRecord | None) -> bool:
    """Whether the storage is on the compute device and not one of the offload's host copies."""
    device, address = key
    if device.type != _compute_device().type:
        return False
    return record is None or all(m.host.data_ptr() != address for m in record.moved)


# --- the verbs -----------------------------------------------------------------------------------


def offload_states(
    optimizer: Any,
    include: Iterable[OffloadStateTypeEnum | str] | None = None,
    *,
    pin_memory: bool = True,
    non_blocking: bool = False,
) -> set[OffloadStateTypeEnum]:
    """Move the state kinds in ``include`` (None: all) from the compute device to host memory.

    Kinds already offloaded are left alone. Returns the kinds offloaded after the call.

    Args:
        optimizer: a ds-zero gradient step (what ``deepspeed.initialize`` returns as optimizer).
        include: ``OffloadStateTypeEnum`` members or their names.
        pin_memory: allocate the host copies page-locked (faster copies back; the accelerator
            decides whether pinning exists).
        non_blocking: queue the copies without waiting for them.

    Example:
        >>> offload_states(zero, include=[OffloadStateTypeEnum.optim_states])
        >>> ...  # generation: the device memory is free
        >>> reload_states(zero)
    """
    kinds = _parse_include(include)
    record = _RECORDS.setdefault(optimizer, _OffloadRecord())
    found = state_tensors(optimizer)
    chosen: dict[tuple[torch.device, int], set[_Kind]] = {}
    for kind in kinds - record.kinds:
        for t in found[kind]:
            key = _key(t)
            if key is not None and _resident(key, record):
                chosen.setdefault(key, set()).add(kind)
    known = [t for ts in found.values() for t in ts]
    sources = {key: _storage_of(key, known) for key in chosen}

    def host_copy(source: torch.UntypedStorage) -> torch.UntypedStorage:
        return _host_storage(source.nbytes(), pin_memory)

    for key, host in _relocate(sources, known, host_copy, non_blocking).items():
        record.moved.append(_Moved(host, key[0], chosen[key]))
    record.kinds |= kinds
    _settle(non_blocking)
    return set(record.kinds)


def reload_states(optimizer: Any, *, non_blocking: bool = False) -> None:
    """Move everything :func:`offload_states` moved back to the device it came from."""
    record = _RECORDS.pop(optimizer, None)
    if record is None:
        return
    known = [t for ts in state_tensors(optimizer).values() for t in ts]
    back: dict[tuple[torch.device, int], torch.device] = {}
    sources: dict[tuple[torch.device, int], torch.UntypedStorage] = {}
    for moved in record.moved:
        key = (torch.device("cpu"), moved.host.data_ptr())
        back[key], sources[key] = moved.device, moved.host
    del record, moved  # the host copies are freed once their views point back at the device

    def device_copy(source: torch.UntypedStorage) -> torch.UntypedStorage:
        device = back[(torch.device("cpu"), source.data_ptr())]
        return torch.empty(source.nbytes(), dtype=torch.uint8, device=device).untyped_storage()

    _relocate(sources, known, device_copy, non_blocking)
    _settle(non_blocking)


def offloaded_states(optimizer: Any) -> set[OffloadStateTypeEnum]:
    """The state kinds currently offloaded for ``optimizer``."""
    record = _RECORDS.get(optimizer)
    return set(record.kinds) if record is not None else set()


def resident_state_bytes(optimizer: Any) -> dict[OffloadStateTypeEnum, int]:
    """Bytes of each state kind resident on the compute device (each storage counted once,
    under the first kind that holds it); offloaded host copies are not resident.

    On a GPU this is the device memory the state occupies; on the CPU accelerator, where the
    compute device is host memory, it is what has not been moved into offload buffers.
    """
    record = _RECORDS.get(optimizer)
    seen: set[tuple[torch.device, int]] = set()
    sizes: dict[_Kind, int] = {}
    for kind, tensors in state_tensors(optimizer).items():
        total = 0
        for t in tensors:
            key = _key(t)
            if key is None or key in seen or not _resident(key, record):
                continue
            seen.add(key)
            total += t.untyped_storage().nbytes()
        sizes[kind] = total
    return sizes


def _parse_include(include: Iterable[OffloadStateTypeEnum | str] | None) -> set[_Kind]:
    if include is None:
        return set(_Kind)
    if isinstance(include, str):
        include = [include]
    kinds: set[_Kind] = set()
    for item in include:
        try:
            kinds.add(_Kind(item))
        except ValueError:
            names = ", ".join(k.value for k in _Kind)
            raise ValueError(
                f"offload_states(include=...): unknown state {item!r}; choose from {names} "
                "(deepspeed.runtime.zero.offload_config.OffloadStateTypeEnum)"
            ) from None
    return kinds


def _settle(non_blocking: bool) -> None:
    """Wait for the copies (unless asked not to) and return freed device memory.

    A host copy may be freed while a non-blocking copy still reads it: torch's pinned
    allocator records the copy's stream and reuses the block only after it, and a copy from
    pageable memory does not return before it has read it."""
    if not non_blocking:
        get_accelerator().synchronize()
    get_accelerator().empty_cache()
