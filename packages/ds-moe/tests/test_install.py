"""The package installs alone and exposes its version."""

from __future__ import annotations

import importlib.metadata

import ds_moe


def test_version_matches_distribution_metadata() -> None:
    assert ds_moe.__version__ == importlib.metadata.version("ds-moe")
