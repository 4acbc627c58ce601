"""Numbers as the profiler prints them: ``1.23 G``, ``4.5 MMACs``, ``12.3 ms``, DeepSpeed's
format (SI prefix chosen by magnitude, rounded to ``precision`` digits, ``%g``)."""

from __future__ import annotations

__all__ = [
    "DEFAULT_PRECISION",
    "bytes_to_string",
    "duration_to_string",
    "flops_to_string",
    "macs_to_string",
    "number_to_string",
    "params_to_string",
]

DEFAULT_PRECISION = 2
_PREFIXES = (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3), ("", 1.0), ("m", 1e-3), ("u", 1e-6))
_SCALE = dict(_PREFIXES)


def _prefix_for(num: float) -> str:
    if num == 0:
        return ""
    for prefix, magnitude in _PREFIXES:
        if num >= magnitude:
            return prefix
    return "u"


def number_to_string(
    num: float, units: str | None = None, precision: int = DEFAULT_PRECISION
) -> str:
    """``num`` scaled to an SI prefix (``units`` forces one: ``"G"``, ``"M"``, ...), e.g.
    ``number_to_string(1.5e9) == "1.5 G"``."""
    prefix = _prefix_for(num) if units is None else units
    magnitude = _SCALE.get(prefix, 1.0)
    return f"{round(num / magnitude, precision):g} {prefix}"


def macs_to_string(
    macs: float, units: str | None = None, precision: int = DEFAULT_PRECISION
) -> str:
    """``"3.2 GMACs"``."""
    return number_to_string(macs, units=units, precision=precision) + "MACs"


def flops_to_string(
    flops: float, units: str | None = None, precision: int = DEFAULT_PRECISION
) -> str:
    """``"3.2 GFLOPS"`` (a rate: FLOPs per second)."""
    return number_to_string(flops, units=units, precision=precision) + "FLOPS"


def bytes_to_string(b: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """``"1.5 GB"``."""
    return number_to_string(b, units=units, precision=precision) + "B"


def params_to_string(
    params_num: float, units: str | None = None, precision: int = DEFAULT_PRECISION
) -> str:
    """``"1.3 B"`` (billions written B, as parameter counts are)."""
    units = units.replace("B", "G") if units else units
    text = number_to_string(params_num, units=units, precision=precision)
    return text.replace("G", "B").strip()


def duration_to_string(
    duration: float, units: str | None = None, precision: int = DEFAULT_PRECISION
) -> str:
    """``"12.3 ms"`` from seconds."""
    return number_to_string(duration, units=units, precision=precision) + "s"
