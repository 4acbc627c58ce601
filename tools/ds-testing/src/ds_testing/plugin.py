"""pytest plugin of ds-testing (entry point ``pytest11``).

Registers the ``slow`` and ``gpu(n=1)`` markers, the ``--ds-timeout`` option, skips ``gpu`` tests
when too few CUDA devices are visible, and shuts worker pools down at session end. It imports
torch only when a ``gpu`` test is about to run.
"""

from __future__ import annotations

import pytest

from ds_testing._config import set_default_timeout
from ds_testing._pool import shutdown_pools


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ds-testing")
    group.addoption(
        "--ds-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="default timeout of each run_on_ranks call (else $DS_TESTING_TIMEOUT or 120)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow: long-running test, excluded from the default CI run (run with -m slow)"
    )
    config.addinivalue_line(
        "markers", "gpu(n=1): needs at least n CUDA GPUs; skipped when fewer are present"
    )
    timeout = config.getoption("--ds-timeout")
    if timeout is not None:
        set_default_timeout(timeout)


def _required_gpus(marker: pytest.Mark) -> int:
    if marker.args:
        return int(marker.args[0])
    return int(marker.kwargs.get("n", 1))


def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("gpu")
    if marker is None:
        return
    from ds_testing.api import gpu_count

    needed, present = _required_gpus(marker), gpu_count()
    if present < needed:
        pytest.skip(f"needs {needed} CUDA GPU(s), {present} present")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutdown_pools()
