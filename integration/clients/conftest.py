"""Fixtures for the client tests: run a scenario once per session, and the DeepSpeed reference."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# The scenario scripts and their launcher live beside the tests and are imported by module name,
# as the scripts themselves do under torchrun.
sys.path.insert(0, str(HERE))

import _launch  # noqa: E402


@pytest.fixture(scope="session")
def reference() -> dict:
    """Per-step losses real DeepSpeed 0.19.8 produced for every scenario (``make_reference.py``)."""
    return json.loads((HERE / "reference.json").read_text())["scenarios"]


@pytest.fixture(scope="session")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], _launch.ScenarioRun]:
    """``scenario(name)`` runs scenario ``name`` on 2 ranks under ds, once per test session.

    A failed run is remembered too, so every test that needs it reports the same tracebacks
    without launching it again.
    """
    runs: dict[str, _launch.ScenarioRun | _launch.ScenarioFailed] = {}

    def run(name: str) -> _launch.ScenarioRun:
        if name not in runs:
            start = _launch.SCENARIOS[name][2]
            start_out = run(start).out if start else None
            try:
                runs[name] = _launch.run_scenario(name, tmp_path_factory.mktemp(name), start_out)
            except _launch.ScenarioFailed as failure:
                runs[name] = failure
        outcome = runs[name]
        if isinstance(outcome, _launch.ScenarioFailed):
            raise outcome
        return outcome

    return run
