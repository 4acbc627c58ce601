"""``deepspeed.launcher.runner``: the ``deepspeed`` command's module, provided by ds-launch.

``python -m ds_engine.launcher.runner ARGS`` runs ``ds-launch ARGS``. See ``ds_launch.runner``
for each name's meaning and where ds-launch differs from DeepSpeed.
"""

from __future__ import annotations

from ds_launch.runner import *  # noqa: F403  (exactly ds-launch's runner API)
from ds_launch.runner import __all__ as __all__
from ds_launch.runner import main

if __name__ == "__main__":
    main()
