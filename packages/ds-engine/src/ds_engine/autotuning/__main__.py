"""``python -m ds_engine.autotuning``: the ``ds-autotune`` command."""

from __future__ import annotations

import sys

from ds_engine.autotuning._cli import main

sys.exit(main())
