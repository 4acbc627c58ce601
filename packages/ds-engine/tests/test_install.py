"""The package installs alone and exposes its version."""

from __future__ import annotations

import importlib.metadata

import ds_engine


def test_version_matches_distribution_metadata() -> None:
    assert ds_engine.__version__ == importlib.metadata.version("ds-engine")
