"""``deepspeed.launcher``: ``launcher.runner`` (the ``deepspeed`` command) and ``launcher.launch``
(the per-node launcher), both provided by ds-launch.

As in DeepSpeed, the submodules are imported by name (``from ds_engine.launcher.runner import
...``), never here: ``python -m ds_engine.launcher.runner`` must find them not yet imported.
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("ds_launch") is None:
    raise ModuleNotFoundError(
        "ds_engine.launcher (DeepSpeed's deepspeed.launcher) is provided by the ds-launch "
        "distribution, which is not installed: pip install ds-launch",
        name="ds_launch",
    )

__all__: list[str] = []
