"""The op-builder registry behind ``get_accelerator().get_op_builder(name)``.

[Note: op builders as a registry]
DeepSpeed's accelerators find op builders by importing ``deepspeed.ops.op_builder`` and scanning
its modules for ``*Builder`` classes. ds-comm is the bottom layer and may not import the package
that defines ds's builders (``ds_engine.ops.op_builder``), so the builders register themselves:
that module calls :func:`register_op_builder` for each class at import. A lookup that misses
imports the accelerator's :meth:`~DeepSpeedAccelerator.op_builder_dir` module once (by name, as
DeepSpeed does), which registers them, then looks again. A name still missing returns None, as
DeepSpeed's CUDA accelerator does.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Iterable

__all__ = [
    "OP_BUILDER_MODULE",
    "lookup",
    "register_op_builder",
    "registered_op_builders",
    "unregister_op_builder",
]

# Where ds's builders live; importing it registers them (see [Note: op builders as a registry]).
OP_BUILDER_MODULE = "ds_engine.ops.op_builder"
_DEVICES = ("cpu", "cuda")

_lock = threading.Lock()
# (name, accelerator name) -> builder class.
_REGISTRY: dict[tuple[str, str], type] = {}
# Modules already imported (or found missing) to fill the registry.
_IMPORTED: set[str] = set()


def register_op_builder(
    name: str, builder: type, *, devices: Iterable[str] = _DEVICES, replace: bool = False
) -> None:
    """Make ``get_accelerator().get_op_builder(name)`` return ``builder`` on ``devices``.

    Args:
        name: DeepSpeed's class name, e.g. ``"CPUAdamBuilder"`` or ``"FusedAdamBuilder"``.
        builder: the class (``get_op_builder`` returns it; ``create_op_builder`` instantiates it
            with no arguments).
        devices: accelerator names (``"cpu"``, ``"cuda"``) it serves; both by default.
        replace: allow replacing a different class already registered under ``name``.

    Raises:
        ValueError: ``name`` already names another class on one of ``devices`` and ``replace``
            is False, or ``devices`` is empty.

    Example:
        >>> register_op_builder("CPUAdamBuilder", CPUAdamBuilder)
        >>> register_op_builder("FusedAdamBuilder", FusedAdamBuilder, devices=["cuda"])
    """
    if not isinstance(builder, type):
        raise TypeError(f"register_op_builder({name!r}): expected a class, got {builder!r}")
    targets = [devices] if isinstance(devices, str) else list(devices)
    if not targets:
        raise ValueError(f"register_op_builder({name!r}): devices is empty")
    with _lock:
        for device in targets:
            known = _REGISTRY.get((name, device))
            if known is not None and known is not builder and not replace:
                raise ValueError(
                    f"register_op_builder({name!r}): {known.__module__}.{known.__qualname__} is "
                    f"already registered for {device}; pass replace=True to replace it"
                )
        for device in targets:
            _REGISTRY[(name, device)] = builder


def unregister_op_builder(name: str, *, devices: Iterable[str] = _DEVICES) -> None:
    """Forget ``name`` on ``devices`` (tests; a plugin being unloaded)."""
    targets = [devices] if isinstance(devices, str) else list(devices)
    with _lock:
        for device in targets:
            _REGISTRY.pop((name, device), None)


def registered_op_builders(device: str) -> dict[str, type]:
    """Every builder registered for accelerator ``device``, by name."""
    with _lock:
        return {name: cls for (name, dev), cls in _REGISTRY.items() if dev == device}


def lookup(name: str, device: str, module: str | None) -> type | None:
    """The builder ``name`` for ``device``, importing ``module`` once on a miss."""
    found = _REGISTRY.get((name, device))
    if found is not None or module is None:
        return found
    with _lock:
        first = module not in _IMPORTED
        _IMPORTED.add(module)
    if first:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name is None or not module.startswith(exc.name):
                _IMPORTED.discard(module)  # the module exists but fails to import: a bug
                raise
        except BaseException:
            _IMPORTED.discard(module)
            raise
    return _REGISTRY.get((name, device))
