"""``deepspeed.moe``: mixture of experts from ds-moe (``pip install ds-engine[moe]``)."""

from __future__ import annotations

from ds_engine._optional import require

require("ds_moe", "ds-moe", "deepspeed.moe (ds_engine.moe)")

__all__: list[str] = []
