"""Helpers shared by the scripts in ``tools/bench`` (not benchmarks themselves: a subfolder, so
the ``bench`` nox session, which runs every ``tools/bench/*.py``, does not run them)."""
