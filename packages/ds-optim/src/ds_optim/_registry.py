"""build_optimizer: DeepSpeed's ``optimizer`` config section to an optimizer; register_optimizer.

Each type resolves to a constructor (a "target") called as ``target(params, **section_params)``;
the parameter names a type accepts are read from its target's signature, so they stay right as
the optimizers change. The 1-bit optimizers and CPUAdam are imported only when asked for.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ds_comm.api import check_keys, closest
from ds_optim.api import ConfigError, OptimizerConfig

OptimizerFactory = Callable[..., torch.optim.Optimizer]
"""``factory(params, **section_params) -> torch.optim.Optimizer``."""

# [Note: DeepSpeed's "Adam" is AdamW]
# DeepSpeed builds {"type": "Adam"} as FusedAdam(adam_w_mode=True): decoupled weight decay,
# i.e. torch.optim.AdamW, unless "params" says "adam_w_mode": false. "AdamW" is decoupled
# whatever adam_w_mode says. "torch_adam": true builds torch.optim.Adam/AdamW instead (with the
# same choice), and with ZeRO-Offload (offload=True) the CPU optimizer CPUAdam is built. A
# "weight_decay" copied from a torch.optim.Adam recipe therefore means something else here:
# set "adam_w_mode": false to get L2 regularisation.
_ADAM_EXTRAS = ("torch_adam", "adam_w_mode")

# [Note: Muon is refused]
# DeepSpeed's "Muon" is MuonWithAuxAdam: every parameter is tagged use_muon (2-D and not an
# embedding/head: Muon, orthogonalised by Newton-Schulz over the whole matrix; the rest: an
# auxiliary Adam), with muon_lr/adam_lr/ns_method/... params, and its ZeRO optimizers
# orthogonalise each whole gradient matrix before partitioning it. ds's ZeRO optimizers (every
# stage, 0 included) hand the optimizer flat fp32 partitions, where no matrix exists, so neither
# DeepSpeed's Muon nor torch.optim.Muon (which the torch.optim fallback would otherwise pick and
# which then fails on the first 1-D tensor) can run. The type is refused by name until the ZeRO
# layer can step a matrix-wise optimizer; register_optimizer("Muon", ...) still overrides this.
_NOT_IMPLEMENTED_TYPES = {
    "muon": (
        "DeepSpeed's Muon optimizer (Newton-Schulz orthogonalised momentum on whole weight "
        "matrices, with an auxiliary Adam for the others)"
    ),
}


@dataclass(frozen=True)
class _Entry:
    """One optimizer type: its display name and how a section resolves to a constructor."""

    name: str
    resolve: Callable[[dict[str, Any], bool], tuple[Callable[..., Any], dict[str, Any]]]
    candidates: Callable[[], list[Callable[..., Any]]]
    extras: tuple[str, ...] = field(default=())


_REGISTRY: dict[str, _Entry] = {}


def register_optimizer(name: str, factory: OptimizerFactory, *, replace: bool = False) -> None:
    """Adds an optimizer type to :func:`build_optimizer` (type names are case-insensitive).

    Args:
        name: The ``optimizer.type`` value that selects ``factory``.
        factory: Called as ``factory(params, **section_params)``; the section's parameter
            names are checked against its signature (any name when it takes ``**kwargs``).
        replace: Replace an existing type of that name instead of raising.

    Raises:
        ValueError: ``name`` is empty or already registered (and ``replace`` is False).
        TypeError: ``factory`` is not callable.

    Example:
        >>> ds_optim.register_optimizer("RAdam", torch.optim.RAdam)
        >>> ds_optim.build_optimizer({"type": "radam", "params": {"lr": 1e-3}}, model.parameters())
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"register_optimizer: name must be a non-empty string, got {name!r}")
    if not callable(factory):
        raise TypeError(f"register_optimizer: factory must be callable, got {factory!r}")
    key = name.strip().lower()
    if key in _REGISTRY and not replace:
        raise ValueError(
            f"register_optimizer: optimizer type {_REGISTRY[key].name!r} is already registered; "
            "pass replace=True to replace it"
        )
    _REGISTRY[key] = _fixed(name.strip(), lambda: factory)


def build_optimizer(
    config: Mapping[str, Any] | OptimizerConfig,
    params: Iterable[Any],
    *,
    offload: bool = False,
    group: Any = None,
) -> torch.optim.Optimizer:
    """Builds the optimizer that DeepSpeed's ``optimizer`` section describes.

    Types (case-insensitive): ``Adam``, ``AdamW`` (FusedAdam; see [Note: DeepSpeed's "Adam" is
    AdamW]: ``Adam`` also decays weights decoupled unless ``adam_w_mode`` is false; with
    ``torch_adam`` torch.optim.Adam/AdamW), ``Lamb`` (FusedLamb), ``OneBitAdam``,
    ``ZeroOneAdam``, ``OneBitLamb``, ``Lion``, ``Adagrad``, ``SGD`` (torch.optim.SGD), types
    added with :func:`register_optimizer`, and, as in DeepSpeed, any other ``torch.optim``
    class by name.

    Args:
        config: The section (``{"type": ..., "params": {...}}``) or an :class:`OptimizerConfig`.
        params: Model params or param groups.
        offload: The optimizer runs on the CPU under ZeRO-Offload: ``Adam``/``AdamW`` build
            CPUAdam, as DeepSpeed does.
        group: The data-parallel process group, handed to optimizers that average their own
            gradients (``reduces_gradients``, the 1-bit ones); a JSON config cannot name one.
            Ignored by the others. None: the default group.

    Raises:
        ConfigError: Unknown type (the message lists the known ones), unknown parameter (the
            message names it, the type and the accepted names), or a value the optimizer
            rejects.

    Example:
        >>> section = {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}}
        >>> opt = ds_optim.build_optimizer(section, model.parameters())
    """
    if not isinstance(config, OptimizerConfig):
        config = OptimizerConfig.from_dict(config)
    entry = _lookup(config.type)
    target, kwargs = entry.resolve(dict(config.params), offload)
    _check_names(entry, config.params, [target])
    if group is not None and _reduces_gradients(target):
        kwargs["group"] = group
    try:
        return target(params, **kwargs)
    except ValueError as exc:
        raise ConfigError(f"optimizer (type {entry.name!r}): {exc}") from exc


def check_optimizer_section(type_name: str, params: Mapping[str, Any]) -> tuple[str, dict]:
    """Validates an ``optimizer`` section's type and parameter names (for OptimizerConfig).

    Returns the type's canonical name and a copy of ``params``. Names are checked against every
    constructor the type can build (e.g. ``Adam``: FusedAdam, CPUAdam or torch's Adam/AdamW);
    :func:`build_optimizer` checks them again against the one it builds.
    """
    if not isinstance(type_name, str) or not type_name.strip():
        raise ConfigError(f"optimizer.type = {type_name!r}: expected an optimizer name, e.g. Adam")
    if not isinstance(params, Mapping):
        raise ConfigError(f"optimizer.params = {params!r}: expected a mapping (a JSON object)")
    for key in params:
        if not isinstance(key, str):
            raise ConfigError(f"optimizer.params key {key!r}: expected a string")
    entry = _lookup(type_name)
    candidates = entry.candidates()
    # An optimizer that reduces its own gradients (the 1-bit ones) sees the only global
    # gradient, so it clips; the others leave clipping to the engine, as DeepSpeed does.
    if "max_grad_norm" in params and not any(_reduces_gradients(c) for c in candidates):
        raise ConfigError(
            f"optimizer.params.max_grad_norm is not supported for type {entry.name!r} (as in "
            'DeepSpeed): clip gradients with the top-level "gradient_clipping" key instead'
        )
    _check_names(entry, params, candidates)
    return entry.name, dict(params)


def known_optimizer_types() -> list[str]:
    """The registered type names (torch.optim classes are accepted too, by name)."""
    return [entry.name for entry in _REGISTRY.values()]


def _lookup(type_name: str) -> _Entry:
    key = type_name.strip().lower()
    if key in _REGISTRY:
        return _REGISTRY[key]
    if key in _NOT_IMPLEMENTED_TYPES:
        raise ConfigError(
            f"optimizer.type = {type_name!r} asks for {_NOT_IMPLEMENTED_TYPES[key]}, which is "
            "not implemented in ds: ds's ZeRO optimizers step flat partitions, not whole "
            'matrices; use another type (e.g. "AdamW")'
        )
    torch_classes = _torch_optimizers()
    if key in torch_classes:
        return _fixed(torch_classes[key].__name__, lambda: torch_classes[key])
    known = known_optimizer_types()
    close = closest(key, (k.lower() for k in known))
    hint = f"did you mean {_REGISTRY[close].name!r}? " if close else ""
    raise ConfigError(
        f"optimizer.type = {type_name!r} is not a known optimizer; {hint}known types "
        f"(case-insensitive): {', '.join(known)}, or a torch.optim class name such as RMSprop"
    )


def _check_names(
    entry: _Entry, params: Mapping[str, Any], targets: list[Callable[..., Any]]
) -> None:
    accepted: set[str] = set(entry.extras)
    for target in targets:
        names = _parameter_names(target)
        if names is None:
            return
        accepted |= names
    check_keys(
        "optimizer.params",
        params,
        accepted,
        what=f"a parameter of optimizer type {entry.name!r}",
        listing="accepted",
        always_list=True,
    )


def _parameter_names(target: Callable[..., Any]) -> set[str] | None:
    """Keyword names ``target(params, ...)`` takes after ``params``; None when it takes any."""
    parameters = list(inspect.signature(target).parameters.values())[1:]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    usable = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in parameters if p.kind in usable}


def _reduces_gradients(target: Callable[..., Any]) -> bool:
    return getattr(target, "reduces_gradients", False) is True


def _torch_optimizers() -> dict[str, type[torch.optim.Optimizer]]:
    classes = {}
    for attr in dir(torch.optim):
        value = getattr(torch.optim, attr)
        is_optimizer = isinstance(value, type) and issubclass(value, torch.optim.Optimizer)
        if is_optimizer and value is not torch.optim.Optimizer:
            classes[attr.lower()] = value
    return classes


def _import(module: str, attr: str, type_name: str) -> Callable[..., Any]:
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"optimizer.type = {type_name!r} is unavailable: {module}.{attr} failed to import "
            f"({exc})"
        ) from exc


def _fixed(name: str, load: Callable[[], Callable[..., Any]]) -> _Entry:
    """A type that always builds ``load()`` with the section's params as they are."""
    return _Entry(
        name=name, resolve=lambda kwargs, offload: (load(), kwargs), candidates=lambda: [load()]
    )


def _adam_entry(name: str) -> _Entry:
    def resolve(kwargs: dict[str, Any], offload: bool) -> tuple[Callable[..., Any], dict]:
        torch_adam = _flag(kwargs.pop("torch_adam", False), "torch_adam")
        decoupled = _flag(kwargs.pop("adam_w_mode", True), "adam_w_mode") or name == "AdamW"
        if torch_adam:
            return (torch.optim.AdamW if decoupled else torch.optim.Adam), kwargs
        if offload:
            cpu_adam = _import("ds_optim._cpu_adam", "CPUAdam", name)
            names = _parameter_names(cpu_adam) or set()
            kwargs["adamw_mode" if "adamw_mode" in names else "adam_w_mode"] = decoupled
            return cpu_adam, kwargs
        from ds_optim._fused_adam import FusedAdam

        return FusedAdam, {**kwargs, "adam_w_mode": decoupled}

    def candidates() -> list[Callable[..., Any]]:
        from ds_optim._fused_adam import FusedAdam

        found: list[Callable[..., Any]] = [FusedAdam, torch.optim.Adam, torch.optim.AdamW]
        # Without CPUAdam, offload=True fails at build time, saying why.
        with contextlib.suppress(ConfigError):
            found.append(_import("ds_optim._cpu_adam", "CPUAdam", name))
        return found

    return _Entry(name=name, resolve=resolve, candidates=candidates, extras=_ADAM_EXTRAS)


def _flag(value: object, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"optimizer.params.{key} = {value!r}: expected true or false")
    return value


def _lazy(name: str, module: str, attr: str) -> _Entry:
    return _fixed(name, lambda: _import(module, attr, name))


def _register_builtins() -> None:
    entries = [
        _adam_entry("Adam"),
        _adam_entry("AdamW"),
        _lazy("Lamb", "ds_optim._lamb", "FusedLamb"),
        _lazy("OneBitAdam", "ds_optim._onebit_adam", "OneBitAdam"),
        _lazy("ZeroOneAdam", "ds_optim._zero_one_adam", "ZeroOneAdam"),
        _lazy("OneBitLamb", "ds_optim._onebit_lamb", "OneBitLamb"),
        _lazy("Lion", "ds_optim._lion", "Lion"),
        _lazy("Adagrad", "ds_optim._adagrad", "Adagrad"),
        _fixed("SGD", lambda: torch.optim.SGD),
    ]
    for entry in entries:
        _REGISTRY[entry.name.lower()] = entry


_register_builtins()
