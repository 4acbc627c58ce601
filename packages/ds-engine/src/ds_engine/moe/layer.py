"""``deepspeed.moe.layer``: ds-moe's ``MoE`` layer."""

from __future__ import annotations

from ds_engine._optional import require

MoE = require("ds_moe", "ds-moe", "deepspeed.moe.layer.MoE").MoE

__all__ = ["MoE"]
