"""Check the wheelhouse ``nox -s build`` wrote: one wheel and one sdist per member, at its version.

Native members (those with a ``setup.py``: ds-native, ds-offload-aio) must come out as platform
wheels holding their compiled cffi extension and no ``_build_error.txt``: their sdists still
install without a compiler (the fallback their ``setup.py`` notes describe, tested in each
member's ``tests/test_packaging.py``), but a release wheel built without its extension would ship
the fallback to every user, so here that is an error naming the reason the build recorded.

Run from the repository root: ``python tools/release/check_wheels.py [DIST]``.
"""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path

import tomllib

MEMBER_GLOBS = ("packages/*", "kernels/*", "tools/ds-testing")


def members(root: Path) -> dict[str, tuple[Path, str]]:
    """distribution name -> (folder, version), from each member's pyproject.toml."""
    out = {}
    for pattern in MEMBER_GLOBS:
        for folder in sorted(root.glob(pattern)):
            if (folder / "pyproject.toml").is_file():
                project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
                out[project["name"]] = (folder, project["version"])
    return out


def check(root: Path, dist: Path) -> list[str]:
    """Problems with ``dist`` (empty: the wheelhouse is complete)."""
    problems = []
    for name, (folder, version) in members(root).items():
        stem = f"{re.sub(r'[-.]+', '_', name)}-{version}"
        wheels = sorted(dist.glob(f"{stem}-*.whl"))
        if len(wheels) != 1 or not (dist / f"{stem}.tar.gz").is_file():
            problems.append(f"{name} {version}: expected one wheel and {stem}.tar.gz in {dist}")
            continue
        if not (folder / "setup.py").is_file():
            continue
        wheel = wheels[0]
        with zipfile.ZipFile(wheel) as zf:
            names = zf.namelist()
            errors = [n for n in names if n.endswith("_build_error.txt")]
            reason = zf.read(errors[0]).decode().strip() if errors else ""
        if wheel.name.endswith("-none-any.whl"):
            problems.append(f"{wheel.name}: a native member must build a platform wheel")
        if errors or not any(n.endswith(".so") for n in names):
            problems.append(
                f"{wheel.name}: built without its C extension ({reason or 'no .so in the wheel'}); "
                "install a C compiler and the headers it needs (tools/setup/system-deps.sh), then "
                "rebuild"
            )
    return problems


def main() -> int:
    dist = Path(sys.argv[1] if len(sys.argv) > 1 else "dist")
    problems = check(Path.cwd(), dist)
    for problem in problems:
        print(f"wheelhouse: {problem}", file=sys.stderr)
    if not problems:
        print(f"wheelhouse {dist}: " + ", ".join(sorted(p.name for p in dist.glob("*.whl"))))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
