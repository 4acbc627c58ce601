"""Async tensor file I/O (libaio through cffi), pinned buffers and a tuning CLI."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
