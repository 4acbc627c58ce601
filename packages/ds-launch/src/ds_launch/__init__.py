"""The ds-launch CLI: start a job on one machine or a cluster."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
