"""Sessions: lint, one isolated test session per distribution, integration, bench.

Each ``test-<dist>`` session syncs ONLY that distribution and its ``test`` dependency group from
``uv.lock`` into a fresh venv, installed as a wheel (not editable), then runs its tests: a
dependency a package forgot to declare fails here, as it would for a user who installs it alone.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = False
nox.options.error_on_missing_interpreters = True

DISTRIBUTIONS = {
    "ds-testing": "tools/ds-testing",
    "ds-comm": "packages/ds-comm",
    "ds-kernels": "kernels/ds-kernels",
    "ds-native": "kernels/ds-native",
    "ds-optim": "packages/ds-optim",
    "ds-offload-aio": "packages/ds-offload-aio",
    "ds-zero": "packages/ds-zero",
    "ds-pipe": "packages/ds-pipe",
    "ds-moe": "packages/ds-moe",
    "ds-launch": "packages/ds-launch",
    "ds-engine": "packages/ds-engine",
    # The opt-in `deepspeed` alias distribution (never a dependency of the ds packages).
    "deepspeed": "packages/deepspeed",
}

# Sessions that use Debian packages for real (sshd, pdsh, libaio, fio); tools/setup/system-deps.sh
# installs whatever is missing first (it needs root and apt-get, as CI has).
NEEDS_SYSTEM_DEPS = {"ds-offload-aio", "ds-launch"}

# The default CI run: everything but benchmarks and tests marked slow.
nox.options.sessions = [
    "lint",
    *(f"test-{name}" for name in DISTRIBUTIONS),
    "integration",
    "clients",
]


def _sync(session: nox.Session, *args: str) -> None:
    """``uv sync`` from the lock file into this session's venv.

    Workspace members are always rebuilt: their version stays 0.1.0 while their sources change,
    and uv would otherwise reuse a cached wheel of older sources.
    """
    rebuild = [f"--reinstall-package={name}" for name in DISTRIBUTIONS]
    session.run_install(
        "uv",
        "sync",
        "--locked",
        "--no-dev",
        "--no-editable",
        *rebuild,
        *args,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
        external=True,
    )


def _system_deps(session: nox.Session) -> None:
    session.run("bash", "tools/setup/system-deps.sh", external=True)


def _pytest(session: nox.Session, *paths: str) -> None:
    args = session.posargs or ["-m", "not slow"]
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    session.run("python", "-m", "pytest", "-q", *paths, *args, env=env)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check + format check on the whole tree, and the import layering contracts."""
    _sync(session, "--all-packages", "--group", "lint")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("lint-imports")


def _make_test_session(name: str, path: str) -> None:
    @nox.session(name=f"test-{name}")
    def test(session: nox.Session) -> None:
        if name in NEEDS_SYSTEM_DEPS:
            _system_deps(session)
        _sync(session, "--package", name, "--group", "test")
        _pytest(session, f"{path}/tests")

    test.__doc__ = f"Install {name} alone (+ its test group) and run its tests."


for _name, _path in DISTRIBUTIONS.items():
    _make_test_session(_name, _path)


@nox.session
def integration(session: nox.Session) -> None:
    """Install the whole stack (ds-engine and everything) and run the cross-package tests."""
    _system_deps(session)
    _sync(session, "--all-packages", "--group", "integration")
    # integration/clients needs transformers, accelerate and Lightning: the `clients` session.
    _pytest(session, "integration", "--ignore=integration/clients")


@nox.session
def clients(session: nox.Session) -> None:
    """transformers, accelerate and Lightning on ds through the opt-in `deepspeed` package.

    2 CPU ranks per scenario, losses compared with real DeepSpeed's (integration/clients).
    """
    _system_deps(session)
    _sync(session, "--all-packages", "--group", "clients")
    _pytest(session, "integration/clients")


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks (not in the default run): print tables next to the peer measured in the same run."""
    _system_deps(session)
    _sync(session, "--all-packages")
    scripts = session.posargs or sorted(path.stem for path in Path("tools/bench").glob("*.py"))
    for script in scripts:
        session.run("python", f"tools/bench/{script}.py")
