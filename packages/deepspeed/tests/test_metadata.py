"""The distribution's metadata passes the checks transformers and accelerate make."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import deepspeed
from packaging import version


def test_distribution_version_is_the_deepspeed_release_reproduced() -> None:
    assert importlib.metadata.version("deepspeed") == "0.19.8"
    assert deepspeed.__version__ == "0.19.8" == deepspeed.version
    assert (deepspeed.__version_major__, deepspeed.__version_minor__) == (0, 19)
    assert deepspeed.__version_patch__ == 8
    assert deepspeed.__git_hash__ == deepspeed.git_hash == "unknown"
    assert deepspeed.__git_branch__ == "unknown"


def test_version_comparisons_the_clients_make() -> None:
    # accelerate: compare_versions("deepspeed", ">=", "0.9.3"), ">=0.5.5", ">=0.11.0", ...
    # transformers: require_version("deepspeed>0.9") and ">=0.16"-style checks.
    found = version.parse(importlib.metadata.version("deepspeed"))
    for floor in ("0.5.5", "0.9", "0.9.3", "0.11.0", "0.14.0", "0.16", "0.19"):
        assert found >= version.parse(floor)
    assert found < version.parse("0.20")


def test_transformers_availability_probe() -> None:
    # transformers' is_deepspeed_available(): a spec, and metadata for the distribution.
    assert importlib.util.find_spec("deepspeed") is not None
    assert importlib.metadata.metadata("deepspeed")["Name"] == "deepspeed"
