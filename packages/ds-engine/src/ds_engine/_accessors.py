"""DeepSpeed's config accessors (``gradient_clipping()``, ``zero_*()``, ...), generated.

[Note: one mechanism for the accessors]
DeepSpeed's engine has about 120 methods that only return a config field. Here they are data: a
table maps each accessor name to the dotted path of its field in the parsed config
(``"zero_max_live_parameters": "zero_optimization.stage3_max_live_parameters"``), and
:func:`install_config_accessors` turns every row into a method that reads ``self._config``
along that path. The table is the config's (``ds_engine._config_accessors.DEEPSPEED_ACCESSORS``,
kept next to the config models it points into). Accessors whose value is
derived (``dynamic_loss_scale()`` is ``loss_scale == 0``, ``zero_optimization()`` is
``stage > 0``) are written out in ``_engine_surface.py`` and win over a table row of the same
name. ``tests/test_engine_surface.py`` checks that every row resolves on a default config.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ds_engine._config_accessors import DEEPSPEED_ACCESSORS

__all__ = ["accessor_table", "install_config_accessors", "read_path"]


def accessor_table() -> dict[str, str]:
    """Every accessor row (see [Note: one mechanism for the accessors])."""
    return dict(DEEPSPEED_ACCESSORS)


def read_path(config: Any, path: str) -> Any:
    """The value at dotted ``path`` in ``config``: attributes of the config models, or keys
    where a section is a plain mapping (``optimizer.params``)."""
    value = config
    for part in path.split("."):
        if hasattr(value, part) or not isinstance(value, Mapping):
            value = getattr(value, part)
        else:
            value = value[part]
    return value


def _accessor(name: str, path: str) -> Callable[[Any], Any]:
    def accessor(self: Any) -> Any:
        return read_path(self._config, path)

    accessor.__name__ = accessor.__qualname__ = name
    accessor.__doc__ = f"DeepSpeed's ``{name}()``: the config's ``{path}``."
    return accessor


def install_config_accessors(cls: type, table: Mapping[str, str] | None = None) -> type:
    """Give ``cls`` one method per row of ``table`` (default :func:`accessor_table`), reading
    ``self._config``; names ``cls`` defines itself are kept (derived accessors)."""
    for name, path in (table if table is not None else accessor_table()).items():
        if any(name in vars(base) for base in cls.__mro__ if base is not object):
            continue
        setattr(cls, name, _accessor(name, path))
    return cls
