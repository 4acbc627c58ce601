"""Runs INSIDE a member's venv (its own interpreter): what pip installed, against what it declares.

``python _probe.py NAME PIP_HOME`` prints one JSON object:

- ``visible``: every distribution this interpreter sees (name -> version);
- ``closure``: the distributions reachable from NAME through ``Requires-Dist`` (markers evaluated
  here, no extras requested), NAME included;
- ``tree``: the same walk as an indented tree (what pip resolved, one line per edge);
- ``modules``: NAME's top-level import packages; ``scripts``: its console scripts;
- ``metadata``: the sha256 of each distribution's ``METADATA`` (copied verbatim from its wheel),
  so the caller can tell that a ds distribution came from the wheelhouse and not from an index
  (PyPI has a ``deepspeed`` of the same version as the alias).

Only the standard library and pip's vendored ``packaging`` are used, so the venv needs nothing
the member does not install itself: the venv holds no pip, and ``PIP_HOME`` (the folder holding
the installing pip) joins ``sys.path`` only after the venv's distributions have been listed.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import sys

# Listed before PIP_HOME joins sys.path, so that pip is not among them.
DISTRIBUTIONS = list(md.distributions())
sys.path.append(sys.argv[2])
from pip._vendor.packaging.requirements import Requirement  # noqa: E402
from pip._vendor.packaging.utils import canonicalize_name  # noqa: E402


def _requirements(dist: md.Distribution, extras: set[str]) -> list[Requirement]:
    """The requirements of ``dist`` that apply here, for the requested ``extras``."""
    out = []
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is None or any(
            req.marker.evaluate({"extra": extra}) for extra in (extras or {""})
        ):
            out.append(req)
    return out


def _walk(root: str, dists: dict[str, md.Distribution]) -> tuple[set[str], list[str]]:
    """Closure of ``root`` and its dependency tree (each node expanded once)."""
    closure: set[str] = set()
    tree: list[str] = []

    def visit(name: str, extras: set[str], depth: int, spec: str) -> None:
        dist = dists.get(name)
        version = dist.version if dist else "MISSING"
        seen = name in closure
        tree.append(f"{'  ' * depth}{name}{spec} [{version}]{' (see above)' if seen else ''}")
        if dist is None or seen:
            return
        closure.add(name)
        for req in _requirements(dist, extras):
            visit(canonicalize_name(req.name), set(req.extras), depth + 1, f" {req.specifier}")

    visit(canonicalize_name(root), set(), 0, "")
    return closure, tree


def main() -> None:
    root = sys.argv[1]
    dists = {canonicalize_name(d.metadata["Name"]): d for d in DISTRIBUTIONS}
    closure, tree = _walk(root, dists)
    dist = dists[canonicalize_name(root)]
    top_level = dist.read_text("top_level.txt")
    if top_level:
        modules = sorted(set(top_level.split()))
    else:  # hatchling writes no top_level.txt: the packages with an __init__.py in RECORD
        modules = sorted(
            {
                str(f).split("/")[0]
                for f in dist.files or []
                if str(f).endswith("/__init__.py") and str(f).count("/") == 1
            }
        )
    scripts = sorted(ep.name for ep in dist.entry_points if ep.group == "console_scripts")
    visible = {name: d.version for name, d in dists.items()}
    print(
        json.dumps(
            {
                "visible": visible,
                "closure": sorted(closure),
                "tree": tree,
                "modules": modules,
                "scripts": scripts,
                "metadata": {
                    name: hashlib.sha256((d.read_text("METADATA") or "").encode()).hexdigest()
                    for name, d in dists.items()
                },
            }
        )
    )


if __name__ == "__main__":
    main()
