"""``deepspeed.ops.op_builder.all_ops``: ``ALL_OPS``, one builder instance per op name."""

from __future__ import annotations

from ds_engine.ops.op_builder._builders import NOT_IMPLEMENTED, PROVIDED
from ds_engine.ops.op_builder.builder import OpBuilder

ALL_OPS: dict[str, OpBuilder] = {cls.NAME: cls() for cls in (*PROVIDED, *NOT_IMPLEMENTED)}

__all__ = ["ALL_OPS"]
