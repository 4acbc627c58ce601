"""Release discipline, checked in the ``lint`` session from git history (README: Release).

For each member, B is the last commit that changed the ``version = ...`` line of its
``pyproject.toml`` (its last version bump).

- Changelog: ``CHANGELOG.md`` has a ``## <version>`` section for the current version, and when
  anything under ``src/`` changed since B (committed or not), ``CHANGELOG.md`` changed too and
  has an ``## Unreleased`` section with at least one entry.
- API compatibility (griffe): the public API now is compared with the API at every bump commit of
  the current version series, that is the same breaking component (``0.2.x``: 0 and 2; from 1.0
  on, the major number), the same boundary the ``>=0.2,<0.3`` ranges of the other members stop
  at. A public name that disappeared or changed its signature since then fails: bump to the next
  series (``0.3.0``) and say so in the changelog. A bump that starts a new series compares with
  nothing.

Skipped for the API check: ``deepspeed`` (its surface is DeepSpeed's, versioned by DeepSpeed's
number and tracked in docs/compat.md) and ``ds-testing`` (never published; the tests that use it
change with it). A shallow clone is deepened first (``git fetch --unshallow``).

Run from the repository root: ``python tools/release/versions_check.py [--no-api]``.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

import tomllib

MEMBER_GLOBS = ("packages/*", "kernels/*", "tools/ds-testing")
NO_API_CHECK = {"deepspeed", "ds-testing"}


def _git(*args: str, check: bool = True) -> str:
    proc = subprocess.run(["git", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise SystemExit(f"git {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout


def _ensure_history() -> None:
    """The checks read history: deepen a shallow clone, or say why they cannot run."""
    if _git("rev-parse", "--is-shallow-repository").strip() != "true":
        return
    proc = subprocess.run(
        ["git", "fetch", "--unshallow", "--quiet"], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(
            "versions check: this clone is shallow and `git fetch --unshallow` failed "
            f"({proc.stderr.strip()}); the changelog and API checks need the history of each "
            "member's version line: clone without --depth."
        )


def _version(text: str) -> str:
    return tomllib.loads(text)["project"]["version"]


def series(version: str) -> tuple[int, ...]:
    """The breaking component of a version: (0, minor) before 1.0, (major,) after."""
    parts = [int(p) for p in re.findall(r"\d+", version)[:2]] + [0]
    return (0, parts[1]) if parts[0] == 0 else (parts[0],)


class Member:
    """One workspace member: its folder, name, current version and version-bump commits."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
        self.name, self.version = project["name"], project["version"]
        log = _git("log", "--format=%H", "-G", r"^version = ", "--", f"{folder}/pyproject.toml")
        self.bumps = [
            (commit, _version(_git("show", f"{commit}:{folder}/pyproject.toml")))
            for commit in log.split()
        ]

    def release_commit(self) -> str:
        """The last version bump, or the later commit that added the current version's changelog
        section (the deepspeed alias is released without a version change: a post-release
        aside, its first ds release kept DeepSpeed's number)."""
        bump = self.bumps[0][0]
        heading = _git(
            "log", "-1", "--format=%H", f"-S## {self.version}", "--", f"{self.folder}/CHANGELOG.md"
        ).strip()
        if heading:
            ancestor = subprocess.run(["git", "merge-base", "--is-ancestor", bump, heading])
            if ancestor.returncode == 0:
                return heading
        return bump

    def changelog_problems(self) -> list[str]:
        changelog = self.folder / "CHANGELOG.md"
        if not changelog.is_file():
            return [f"{self.name}: no {changelog}"]
        text = changelog.read_text()
        problems = []
        if not re.search(rf"(?m)^## {re.escape(self.version)}\b", text):
            problems.append(f"{changelog}: no '## {self.version}' section for the current version")
        if not self.bumps or self.bumps[0][1] != self.version:
            return problems  # the bump itself is not committed yet: nothing came after it
        last_bump = self.release_commit()
        changed = _git("diff", "--name-only", last_bump, "--", f"{self.folder}/src").split()
        if not changed:
            return problems
        unreleased = re.search(r"(?ms)^## Unreleased\s*\n(.*?)(?=^## |\Z)", text)
        touched = _git("diff", "--name-only", last_bump, "--", str(changelog)).strip()
        if not touched or unreleased is None or not re.search(r"(?m)^\s*[-*] ", unreleased[1]):
            problems.append(
                f"{self.name}: {len(changed)} file(s) under src/ changed since its last version bump "
                f"({last_bump[:10]}, {self.version}), e.g. {changed[0]}, with no entry under "
                f"'## Unreleased' in {changelog}: add one (a '- ' line saying what changed)"
            )
        return problems

    def api_baselines(self) -> list[str]:
        """The bump commits of the current series, newest and oldest (deduplicated)."""
        same = []
        for commit, version in self.bumps:
            if series(version) != series(self.version):
                break
            same.append(commit)
        return list(dict.fromkeys([same[0], same[-1]])) if same else []


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0]))


_OPS = {
    "==": lambda a, b: a == b,
    ">=": lambda a, b: a >= b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    "<": lambda a, b: a < b,
    "!=": lambda a, b: a != b,
}


def pin_problems(members: list[Member]) -> list[str]:
    """Every internal requirement admits the required member's current version, and ds-engine
    pins each member it depends on exactly (``==``: the set it was tested with)."""
    versions = {m.name: m.version for m in members}
    problems = []
    for member in members:
        project = tomllib.loads((member.folder / "pyproject.toml").read_text())["project"]
        requirements = list(project.get("dependencies", []))
        for extra in project.get("optional-dependencies", {}).values():
            requirements += extra
        for requirement in requirements:
            match = re.match(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*([^;]*)", requirement)
            name, spec = match.group(1), match.group(3).strip()
            if name not in versions:
                continue
            clauses = [c.strip() for c in spec.split(",") if c.strip()]
            if member.name == "ds-engine" and clauses != [f"=={versions[name]}"]:
                problems.append(
                    f"ds-engine requires {requirement!r}: it pins each member exactly, "
                    f"'{name}=={versions[name]}'"
                )
                continue
            for clause in clauses or [""]:
                op = re.match(r"(==|>=|<=|!=|>|<)", clause)
                admitted = op is not None and _OPS[op.group(1)](
                    _version_tuple(versions[name]), _version_tuple(clause[op.end() :])
                )
                if not admitted:
                    problems.append(
                        f"{member.name} requires {requirement!r}, which does not admit {name} "
                        f"{versions[name]} (give a range such as "
                        f"'>={'.'.join(map(str, series(versions[name])))},<"
                        f"{'.'.join(map(str, _next_series(versions[name])[:2]))}')"
                    )
                    break
    return problems


def _module_name(folder: Path) -> str:
    (package,) = [p.parent.name for p in (folder / "src").glob("*/__init__.py")]
    return package


def api_problems(member: Member) -> list[str]:
    """Breaking changes of the member's public API against each baseline of its series."""
    import griffe

    module = _module_name(member.folder)
    current = griffe.load(module, search_paths=[member.folder / "src"], allow_inspection=False)
    problems = []
    for commit in member.api_baselines():
        archive = subprocess.run(
            ["git", "archive", "--format=tar", commit, f"{member.folder}/src"],
            capture_output=True,
            check=True,
        ).stdout
        with tempfile.TemporaryDirectory() as tmp, tarfile.open(fileobj=BytesIO(archive)) as tar:
            tar.extractall(tmp, filter="data")
            old = griffe.load(
                module, search_paths=[Path(tmp, member.folder, "src")], allow_inspection=False
            )
            for breakage in griffe.find_breaking_changes(old, current):
                if _attribute_became_callable(breakage):
                    continue
                change = f"{breakage.kind.value}: {breakage.old_value!s} -> {breakage.new_value!s}"
                problems.append(
                    f"{member.name} {member.version}: {breakage.obj.path}: {change} "
                    f"(since {commit[:10]}; a breaking change needs the next series: bump "
                    f"{member.version} -> {'.'.join(map(str, _next_series(member.version)))})"
                )
    return problems


def _attribute_became_callable(breakage: object) -> bool:
    """A module or class attribute that is now a class or function (a refusal placeholder or an
    alias replaced by the real thing): the name still resolves, and callers of the old value
    had no signature to rely on, so this is not a break."""
    kind = getattr(breakage, "kind", None)
    old = getattr(breakage, "old_value", None)
    return (
        getattr(kind, "name", "") == "OBJECT_CHANGED_KIND"
        and getattr(old, "value", str(old)) == "attribute"
    )


def _next_series(version: str) -> tuple[int, ...]:
    key = series(version)
    return (0, key[1] + 1, 0) if key[0] == 0 else (key[0] + 1, 0, 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-api", action="store_true", help="changelog check only")
    args = parser.parse_args(argv)
    _ensure_history()
    root = Path(".")
    folders = [
        f for g in MEMBER_GLOBS for f in sorted(root.glob(g)) if (f / "pyproject.toml").is_file()
    ]
    members = [Member(folder) for folder in folders]
    problems = pin_problems(members)
    for member in members:
        folder = member.folder
        if not member.bumps:
            problems.append(f"{member.name}: no commit sets the version in {folder}/pyproject.toml")
            continue
        problems += member.changelog_problems()
        if not args.no_api and member.name not in NO_API_CHECK:
            problems += api_problems(member)
    for problem in problems:
        print(f"versions check: {problem}", file=sys.stderr)
    if not problems:
        print(f"versions check: {len(folders)} members, changelogs and public APIs consistent")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
