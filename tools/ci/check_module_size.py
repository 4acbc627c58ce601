"""Fail when a Python module of a distribution is over the house limit of 800 lines.

Checks every ``.py`` file under ``packages/*/src``, ``kernels/*/src`` and ``tools/ds-testing``
(tests and tools are not distributions' modules). Run by the ``lint`` nox session::

    python tools/ci/check_module_size.py            # from the repository root
    python tools/ci/check_module_size.py --limit 600
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATTERNS = ("packages/*/src/**/*.py", "kernels/*/src/**/*.py", "tools/ds-testing/**/*.py")
LIMIT = 800


def oversized(root: Path, limit: int) -> list[tuple[Path, int]]:
    """Every checked module over ``limit`` lines, with its line count, largest first."""
    found: dict[Path, int] = {}
    for pattern in PATTERNS:
        for path in root.glob(pattern):
            if any(
                part.startswith(".") or part == "build" for part in path.relative_to(root).parts
            ):
                continue
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > limit:
                found[path.relative_to(root)] = lines
    return sorted(found.items(), key=lambda item: -item[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=LIMIT, help="most lines a module may have")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository root")
    args = parser.parse_args(argv)
    over = oversized(args.root, args.limit)
    for path, lines in over:
        print(f"{path}: {lines} lines, over the limit of {args.limit}: split it by concern")
    if over:
        return 1
    print(f"check_module_size: every module is within {args.limit} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
