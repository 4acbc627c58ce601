"""``deepspeed.zero``: ZeRO stage 3 helpers.

``Init`` (partitioned construction) and ``GatheredParameters`` belong to ZeRO stage 3, which
lands with ds-zero part 2; until then using them raises NotImplementedError. Stages 0-2 need
neither: set ``zero_optimization.stage`` in the config.
"""

from __future__ import annotations

from typing import Any

__all__ = ["GatheredParameters", "Init"]

_MESSAGE = (
    "deepspeed.zero.{name} is a ZeRO stage 3 feature; stage 3 lands with ds-zero part 2 and is "
    "not available yet. Stages 0-2 need no {name}: set zero_optimization.stage to 0, 1 or 2"
)


class Init:
    """Stage 3 partitioned model construction (not available yet; raises)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(_MESSAGE.format(name="Init"))


class GatheredParameters:
    """Stage 3 gathering of partitioned parameters (not available yet; raises)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(_MESSAGE.format(name="GatheredParameters"))
