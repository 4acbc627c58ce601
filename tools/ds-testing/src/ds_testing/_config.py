"""Process-wide defaults of the harness (set by the pytest plugin's command-line options)."""

from __future__ import annotations

import os

_FALLBACK_TIMEOUT_S = 120.0
_timeout_override: float | None = None


def set_default_timeout(seconds: float | None) -> None:
    """Override the default per-call timeout (``--ds-timeout``); ``None`` restores env/fallback."""
    global _timeout_override
    _timeout_override = seconds


def default_timeout() -> float:
    """``--ds-timeout`` if given, else ``$DS_TESTING_TIMEOUT``, else 120 s."""
    if _timeout_override is not None:
        return _timeout_override
    return float(os.environ.get("DS_TESTING_TIMEOUT", _FALLBACK_TIMEOUT_S))
