"""ZeRO-3 leaf modules: modules whose whole parameter set is gathered at once at their forward,
with no hooks inside them (see ``_stage3.py``'s [Note: leaf modules]); DeepSpeed's
``set_z3_leaf_modules`` family."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "get_z3_leaf_modules",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
]

ModuleClasses = Sequence[type | str]


def z3_leaf_module(model: torch.nn.Module) -> bool:
    """Whether ``model`` is flagged as a ZeRO-3 leaf."""
    return bool(getattr(model, "_z3_leaf", False))


def z3_leaf_parameter(param: torch.nn.Parameter) -> bool:
    """Whether ``param`` belongs to a module flagged as a ZeRO-3 leaf."""
    return hasattr(param, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules in ``model`` flagged as ZeRO-3 leaves."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(model: torch.nn.Module, flag: bool) -> None:
    """Flag (or unflag) one module as a ZeRO-3 leaf."""
    model._z3_leaf = flag  # type: ignore[assignment]
    for p in model.parameters():
        if flag:
            p.ds_z3_leaf_module = model  # type: ignore[attr-defined]
        elif getattr(p, "ds_z3_leaf_module", None) is model:
            del p.ds_z3_leaf_module  # type: ignore[attr-defined]


def _matches(module: torch.nn.Module, wanted: type | str) -> bool:
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    cls = type(module)
    return wanted in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _set_by_class(
    model: torch.nn.Module, classes: ModuleClasses, flag: bool, raise_if_not_found: bool
) -> list[torch.nn.Module]:
    bad = [c for c in classes if not isinstance(c, (type, str))]
    if bad or isinstance(classes, (str, type)):
        raise TypeError(
            f"leaf_module_classes must be a list of module classes or class names, got {classes!r}"
        )
    found = [m for m in model.modules() if any(_matches(m, c) for c in classes)]
    if not found and raise_if_not_found:
        raise ValueError(
            f"no module of class {list(classes)} in the model; pass classes (or their names, "
            "plain or module-qualified) that occur in it"
        )
    for m in found:
        set_z3_leaf_module(m, flag)
    return found


def set_z3_leaf_modules(
    model: torch.nn.Module, leaf_module_classes: ModuleClasses, raise_if_not_found: bool = True
) -> list[torch.nn.Module]:
    """Flag every module of the given classes as a ZeRO-3 leaf: its parameters are gathered all
    at once when its forward starts and the modules inside it are not hooked, so a
    mixture-of-experts block whose experts run in a data-dependent order (or not at all on some
    ranks) keeps every rank's collectives in step.

    Args:
        model: the model.
        leaf_module_classes: module classes, or class names (``"MixtralSparseMoeBlock"`` or
            module-qualified).
        raise_if_not_found: raise ValueError when nothing matches.

    Returns:
        The flagged modules.

    Example:
        >>> set_z3_leaf_modules(model, [MixtralSparseMoeBlock])
    """
    return _set_by_class(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(
    model: torch.nn.Module, leaf_module_classes: ModuleClasses, raise_if_not_found: bool = True
) -> list[torch.nn.Module]:
    """Remove the ZeRO-3 leaf flag from every module of the given classes."""
    return _set_by_class(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(
    model: torch.nn.Module,
    module_names: Sequence[str],
    flag: bool = True,
    raise_if_not_found: bool = True,
) -> tuple[list[torch.nn.Module], list[str]]:
    """Flag the modules named in ``model.named_modules()``; returns (modules, missing names)."""
    by_name = dict(model.named_modules())
    found = [by_name[n] for n in module_names if n in by_name]
    missing = [n for n in module_names if n not in by_name]
    if missing and raise_if_not_found:
        raise ValueError(f"no modules named {missing} in the model")
    for m in found:
        set_z3_leaf_module(m, flag)
    return found, missing


def set_z3_leaf_modules_by_suffix(
    model: torch.nn.Module,
    module_name_suffixes: Sequence[str],
    flag: bool = True,
    raise_if_not_found: bool = True,
) -> tuple[list[torch.nn.Module], list[str]]:
    """Flag the modules whose name ends with one of the suffixes; returns (modules, missing)."""
    found: dict[int, torch.nn.Module] = {}
    missing = []
    for suffix in module_name_suffixes:
        hits = [m for n, m in model.named_modules() if n.endswith(suffix)]
        if not hits:
            missing.append(suffix)
        found.update((id(m), m) for m in hits)
    if missing and raise_if_not_found:
        raise ValueError(f"no modules whose names end with {missing} in the model")
    for m in found.values():
        set_z3_leaf_module(m, flag)
    return list(found.values()), missing
