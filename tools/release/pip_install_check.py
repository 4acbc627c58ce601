"""Install each member ALONE from the wheelhouse with plain pip, and check what it brought.

For every wheel in ``dist/`` (or the names given), in a fresh, empty ``python -m venv``, plain pip
(never uv) runs ``pip install --find-links dist NAME`` (full dependency resolution, no
``--no-deps``), then

- ``pip check`` passes;
- everything installed is reachable from NAME through its declared ``Requires-Dist`` (nothing
  more, nothing missing), and every ds distribution
  installed is the wheelhouse's own (its METADATA identical), not a same-named one from an index;
- each top-level package imports, and every name in its ``__all__`` resolves;
- each console script runs ``--help`` with exit status 0;
- the dependency tree pip resolved is printed and written to ``<work>/<name>.tree.txt``.

[Note: the torch layer]
torch is the one heavy dependency (hundreds of MB per venv even as a CPU build; PyPI's Linux
default is a CUDA build of several GB). By default pip installs it ONCE, with the same command and
constraints, into a base venv, and each member venv whose declared closure contains torch sees
that venv's site-packages through a ``.pth`` file, so pip resolves ``torch>=2.4`` against it
instead of unpacking it again. The base holds torch and its own dependencies only, all of which
are in the closure of any member that needs torch, so the closure check loses nothing; a member
that does not need torch (ds-launch) gets no layer and must come out torch-free. ``--fresh``
skips the layer: every venv installs torch itself (what ``nox -s release-check`` does for
ds-engine).

torch's build: when pip's find-links (``PIP_FIND_LINKS`` or pip's config) holds a CPU wheel of
torch for this interpreter, torch is pinned to it with a constraints file; ``DS_PIP_TORCH`` overrides
that (``DS_PIP_TORCH=torch==2.6.0+cpu``; empty: no pin, the index decides).

[Note: pip from outside the venv]
The venvs are made ``--without-pip`` and this interpreter's pip installs into them
(``pip --python VENV_PYTHON``, pip 22.3 or newer): the same resolver and installer a user's
``venv/bin/pip`` runs. Seeding each venv with its own pip (``ensurepip``) cost 7.5 s of CPU per
venv on the 2-core VM, mostly byte-compiling pip and setuptools, thirteen times a run; and with
nothing in the venv but what NAME brought, the closure check has no exceptions to make. For the
same reason installs pass ``--no-compile``: the import check compiles what it imports, and
nothing else is ever run. The probe (``_probe.py``, run by the venv's interpreter) borrows
``packaging`` from this pip after it has listed the venv's distributions.

Run from the repository root: ``python tools/release/pip_install_check.py [--fresh] [NAME ...]``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import email.parser
import hashlib
import json
import os
import re
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import pip

PROBE = Path(__file__).with_name("_probe.py")
# The oldest pip with `--python` (see [Note: pip from outside the venv]).
PIP_WITH_PYTHON_OPTION = (22, 3)
# The folder holding this interpreter's pip (the probe borrows its ``packaging``).
PIP_HOME = str(Path(pip.__file__).resolve().parents[1])


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _wheels(dist: Path) -> dict[str, dict[str, object]]:
    """name -> {"wheel", "version", "requires"} read from each wheel's METADATA."""
    out: dict[str, dict[str, object]] = {}
    for wheel in sorted(dist.glob("*.whl")):
        with zipfile.ZipFile(wheel) as zf:
            (meta,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
            text = zf.read(meta).decode()
            msg = email.parser.Parser().parsestr(text)
        requires = [
            _canonical(re.match(r"[A-Za-z0-9_.-]+", line).group(0))
            for line in msg.get_all("Requires-Dist") or []
            if "extra ==" not in line
        ]
        out[_canonical(msg["Name"])] = {
            "wheel": wheel,
            "version": msg["Version"],
            "requires": requires,
            "metadata": hashlib.sha256(text.encode()).hexdigest(),
        }
    return out


def _needs_torch(name: str, wheels: dict[str, dict[str, object]]) -> bool:
    """Whether torch is in ``name``'s declared closure (through the members in the wheelhouse)."""
    todo, seen = [name], set()
    while todo:
        current = todo.pop()
        if current == "torch":
            return True
        if current in seen or current not in wheels:
            continue
        seen.add(current)
        todo.extend(wheels[current]["requires"])  # type: ignore[arg-type]
    return False


def _find_links() -> list[Path]:
    """pip's find-links locations (environment and config files), as directories."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    ).stdout
    values = re.findall(r"find-links='([^']*)'", out)
    values.append(os.environ.get("PIP_FIND_LINKS", ""))
    return [Path(v) for value in values for v in value.split() if v and Path(v).is_dir()]


def torch_constraint() -> str | None:
    """``torch==X+cpu`` for a CPU torch wheel pip can already see, or the ``DS_PIP_TORCH`` override."""
    if "DS_PIP_TORCH" in os.environ:
        return os.environ["DS_PIP_TORCH"] or None
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    arch = sysconfig.get_platform().split("-")[-1]
    found = []
    for folder in _find_links():
        for wheel in folder.glob(f"torch-*+cpu-{tag}-{tag}-*{arch}.whl"):
            version = wheel.name.split("-")[1]
            found.append(
                (tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])), version)
            )
    return f"torch=={max(found)[1]}" if found else None


def _venv(path: Path) -> Path:
    """A fresh, empty venv made by plain ``python -m venv``; returns its interpreter."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--clear", "--without-pip", str(path)], check=True
    )
    return path / "bin" / "python"


def _pip(python: Path, *args: str) -> list[str]:
    """This interpreter's pip acting on ``python``'s environment."""
    return [sys.executable, "-m", "pip", "--python", str(python), *args]


def _require_pip_with_python_option() -> None:
    version = tuple(int(part) for part in re.findall(r"\d+", pip.__version__)[:2])
    if version < PIP_WITH_PYTHON_OPTION:
        raise SystemExit(
            f"pip {pip.__version__} in {sys.executable} has no --python option; upgrade it to 22.3"
            f" or newer: {sys.executable} -m pip install -U pip"
        )


def _site_packages(python: Path) -> str:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return subprocess.run(
        [python, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()


def _pip_install(python: Path, args: list[str], log: Path) -> str:
    """``pip install`` with the shared flags; the output goes to ``log``; returns its summary line."""
    proc = subprocess.run(
        _pip(python, "install", "--disable-pip-version-check", "--no-compile", *args),
        capture_output=True,
        text=True,
    )
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(
            f"pip install {' '.join(args)} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("Successfully installed")]
    return lines[-1] if lines else "(nothing new installed)"


class Checker:
    """One wheelhouse, one work folder, one optional torch layer."""

    def __init__(self, dist: Path, work: Path, fresh: bool) -> None:
        self.dist, self.work, self.fresh = dist.resolve(), work.resolve(), fresh
        self.wheels = _wheels(self.dist)
        _require_pip_with_python_option()
        self.work.mkdir(parents=True, exist_ok=True)
        self.constraints = self.work / "constraints.txt"
        pin = torch_constraint()
        self.constraints.write_text(f"{pin}\n" if pin else "")
        print(f"torch: {pin or 'unpinned (the index decides)'}", flush=True)
        self.layer: str | None = None

    def _pip_args(self, *names: str) -> list[str]:
        return ["--find-links", str(self.dist), "-c", str(self.constraints), *names]

    def torch_layer(self) -> str:
        """The base venv's site-packages, holding torch and its dependencies (made once, and
        kept in the work folder for the next run with the same torch pin: it is only a cache of
        pip's own install of torch)."""
        if self.layer is None:
            start = time.monotonic()
            folder, marker = self.work / "torch-layer", self.work / "torch-layer.ok"
            # The pin, and the layout: a layer kept from before the venvs were made without pip
            # would lend the members its pip and setuptools.
            key = f"{self.constraints.read_text()}venv --without-pip\n"
            if marker.is_file() and marker.read_text() == key and folder.is_dir():
                summary = f"reused {folder} ({key.splitlines()[0] or 'torch'})"
            else:
                marker.unlink(missing_ok=True)
                python = _venv(folder)
                summary = _pip_install(
                    python, self._pip_args("torch"), self.work / "torch-layer.log"
                )
                marker.write_text(key)
            self.layer = _site_packages(folder / "bin" / "python")
            print(f"torch layer: {summary} ({time.monotonic() - start:.0f} s)", flush=True)
        return self.layer

    def check(self, name: str) -> list[str]:
        """Install ``name`` alone and check it; returns the problems found (empty: passed)."""
        start = time.monotonic()
        python = _venv(self.work / name)
        if not self.fresh and _needs_torch(name, self.wheels):
            Path(_site_packages(python), "_ds_torch_layer.pth").write_text(
                self.torch_layer() + "\n"
            )
        summary = _pip_install(python, self._pip_args(name), self.work / f"{name}.log")
        problems = []
        pip_check = subprocess.run(_pip(python, "check"), capture_output=True, text=True)
        if pip_check.returncode != 0:
            problems.append(f"pip check: {pip_check.stdout.strip()}")
        probe = json.loads(
            subprocess.run(
                [python, PROBE, name, PIP_HOME], capture_output=True, text=True, check=True
            ).stdout
        )
        visible, closure = set(probe["visible"]), set(probe["closure"])
        if extra := sorted(visible - closure):
            problems.append(f"installed but not declared by {name} (or its dependencies): {extra}")
        if missing := sorted(closure - visible):
            problems.append(f"declared but not installed: {missing}")
        foreign = [
            f"{dist} {probe['visible'][dist]}"
            for dist in sorted(visible & set(self.wheels))
            if probe["metadata"].get(dist) != self.wheels[dist]["metadata"]
        ]
        if foreign:
            problems.append(f"installed from somewhere else than {self.dist}: {foreign}")
        problems += self._imports(python, probe["modules"])
        problems += self._scripts(python, probe["scripts"])
        tree = "\n".join(probe["tree"])
        (self.work / f"{name}.tree.txt").write_text(f"{summary}\n{tree}\n")
        status = "FAILED" if problems else "ok"
        report = [f"\n== {name}: {status} ({time.monotonic() - start:.0f} s)", summary, tree]
        report += [f"   problem: {problem}" for problem in problems]
        print("\n".join(report), flush=True)  # one write: checks may run in parallel
        return problems

    @staticmethod
    def _imports(python: Path, modules: list[str]) -> list[str]:
        """Each top-level package imports and every name in its ``__all__`` resolves."""
        code = (
            "import importlib, sys\n"
            "for name in sys.argv[1:]:\n"
            "    module = importlib.import_module(name)\n"
            "    for attr in getattr(module, '__all__', ()):\n"
            "        getattr(module, attr)\n"
        )
        if not modules:
            return ["no top-level package found in the wheel"]
        proc = subprocess.run([python, "-c", code, *modules], capture_output=True, text=True)
        return [] if proc.returncode == 0 else [f"public API import: {proc.stderr.strip()[-2000:]}"]

    @staticmethod
    def _scripts(python: Path, scripts: list[str]) -> list[str]:
        """Each console script runs ``--help`` (exit 0, something printed)."""
        problems = []
        for script in scripts:
            proc = subprocess.run(
                [python.parent / script, "--help"], capture_output=True, text=True, timeout=300
            )
            if proc.returncode != 0 or not proc.stdout.strip():
                problems.append(
                    f"{script} --help: exit {proc.returncode}\n{proc.stdout[-1000:]}{proc.stderr[-2000:]}"
                )
        return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "names", nargs="*", help="members to check (default: every wheel in --dist)"
    )
    parser.add_argument("--dist", type=Path, default=Path("dist"), help="the wheelhouse")
    parser.add_argument(
        "--work", type=Path, default=Path("build/pip-install"), help="venvs and logs"
    )
    parser.add_argument("--fresh", action="store_true", help="no shared torch layer (see the note)")
    parser.add_argument(
        "--jobs", type=int, default=min(os.cpu_count() or 1, 4), help="members checked at once"
    )
    args = parser.parse_args(argv)
    checker = Checker(args.dist, args.work, args.fresh)
    names = args.names or sorted(checker.wheels)
    if unknown := sorted(set(names) - set(checker.wheels)):
        parser.error(f"no wheel in {args.dist} for {unknown}; run `nox -s build` first")
    if not args.fresh and any(_needs_torch(name, checker.wheels) for name in names):
        checker.torch_layer()  # once, before the parallel checks share it
    with concurrent.futures.ThreadPoolExecutor(max(args.jobs, 1)) as pool:
        results = dict(zip(names, pool.map(checker.check, names)))
    failed = {name: problems for name, problems in results.items() if problems}
    if failed:
        print(f"\nFAILED: {sorted(failed)}", file=sys.stderr)
        return 1
    print(f"\nall {len(names)} members install alone with pip: {', '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
