"""initialize(), the training engine and config: the ds_engine namespace."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
