"""``deepspeed.runtime.pipe.engine``: the engine ``initialize()`` returns for a
``PipelineModule``.

``PipelineEngine`` is ds-engine's pipeline engine (ds-pipe's schedule executor configured by
the DeepSpeed config), the class of what ``deepspeed.initialize(model=PipelineModule(...))``
returns, so ``isinstance`` checks on it hold.
"""

from __future__ import annotations

from ds_engine._optional import require

require("ds_pipe", "ds-pipe", "deepspeed.runtime.pipe.engine")

from ds_engine._pipe import PipelineDeepSpeedEngine  # noqa: E402  (after the install check)

PipelineEngine = PipelineDeepSpeedEngine

__all__ = ["PipelineEngine"]
