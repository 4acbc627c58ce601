"""Sessions: lint, one isolated test session per distribution, integration, bench.

Each ``test-<dist>`` session syncs ONLY that distribution and its ``test`` dependency group from
``uv.lock`` into a fresh venv, installed as a wheel (not editable), then runs its tests: a
dependency a package forgot to declare fails here, as it would for a user who installs it alone.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"

# The session venvs are throwaway, so Python may cache compiled modules in them. Where the
# environment sets PYTHONDONTWRITEBYTECODE (this project's 2-core VMs do), every process recompiled
# torch's Python modules each time it imported torch: 6.0 s against 3.4 s per import on the
# 2-core VM, in a suite that starts a process of its own for every rank, launcher and client run
# (ds-launch's tests: 117 s before, 85 s with the modules cached).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
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
    # The wheelhouse, then each member installed alone from it with plain pip (README: Release).
    "build",
    "pip-install",
]


def _sync(session: nox.Session, *args: str) -> None:
    """``uv sync`` from the lock file into this session's venv.

    Workspace members are always rebuilt: a member's version changes only when it is released
    (CHANGELOG.md), its sources change between releases, and uv would otherwise reuse a cached
    wheel of older sources under the same version.
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
    # The slowest tests are listed so that the 25-minute budget can be kept (README: Tests).
    args = session.posargs or ["-m", "not slow", "--durations=15"]
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    session.run("python", "-m", "pytest", "-q", *paths, *args, env=env)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check + format check on the whole tree, the import layering contracts, pyright."""
    _sync(session, "--all-packages", "--group", "lint")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("lint-imports")
    # pyright (basic; [tool.pyright] in pyproject.toml) in this venv, where the workspace is
    # installed, so it resolves every import the sources make.
    session.run_install(
        "uv",
        "pip",
        "install",
        "pyright[nodejs]==1.1.414",
        external=True,
        env={"VIRTUAL_ENV": session.virtualenv.location},
    )
    session.run("pyright")
    session.run("python", "tools/ci/check_module_size.py")  # no module over 800 lines
    # Changelog entry for every source change since a member's last version bump; no public-API
    # breakage within a version series (README: Release).
    session.run("python", "tools/release/versions_check.py")


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


@nox.session(venv_backend="none")
def build(session: nox.Session) -> None:
    """Wheels and sdists of every member into dist/ (each wheel built from its sdist).

    ds-native and ds-offload-aio build platform wheels with their C extensions (libaio-dev from
    the system deps); tools/release/check_wheels.py fails a native wheel built without them.
    """
    _system_deps(session)
    shutil.rmtree("dist", ignore_errors=True)
    session.run("uv", "build", "--all-packages", "--out-dir", "dist", external=True)
    session.run("python", "tools/release/check_wheels.py", "dist", external=True)


@nox.session(name="pip-install", venv_backend="none")
def pip_install(session: nox.Session) -> None:
    """Each member alone from dist/ with plain pip in a fresh venv: only its declared dependencies,
    its public API imports, its console scripts run (tools/release/pip_install_check.py).

    Needs ``nox -s build`` first; ``-- NAME ...`` checks some members, ``-- --fresh`` installs
    torch in every venv instead of once (the script's [Note: the torch layer]).
    """
    session.run("python", "tools/release/pip_install_check.py", *session.posargs, external=True)


@nox.session(name="release-check", venv_backend="none")
def release_check(session: nox.Session) -> None:
    """Slow tier: plain pip installs ds-engine (torch included) from dist/ into a fresh venv, and
    the README's main job (the example GPT, ZeRO-2, 2 local ranks) runs on it. After ``build``."""
    session.run("python", "tools/release/main_job_check.py", external=True)
