"""DeepSpeed's public surface, checked name by name against ds's ``deepspeed`` package.

``tools/compat/deepspeed_surface.json`` lists DeepSpeed 0.19.8's module paths, their names, and
the members of its engines and accelerator (read from a real DeepSpeed by
``tools/compat/inventory.py``). This test imports each path from ds's opt-in ``deepspeed``
package, records which names exist, prints the table, and writes ``docs/compat-surface.md``
from it. Missing names do not fail it yet (ds is still filling the surface in); it fails when
the inventory is malformed, or when a name ds already provides and clients depend on (the
``REQUIRED`` list) disappears.

Engine and accelerator members are looked up on real objects: a one-rank ``DeepSpeedEngine``
(and ``PipelineEngine``) built through ``ds_testing.run_on_ranks``, and ``get_accelerator()``,
because many of DeepSpeed's members are instance attributes that no class shows.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ds_testing import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]
INVENTORY = ROOT / "tools" / "compat" / "deepspeed_surface.json"
DOC = ROOT / "docs" / "compat-surface.md"
# Names ds provides today that clients import: losing one is a regression, not a gap.
REQUIRED = {
    "deepspeed": ("initialize", "init_distributed", "DeepSpeedEngine", "zero", "comm"),
    "deepspeed.launcher.runner": ("DEEPSPEED_ENVIRONMENT_NAME", "main", "parse_args"),
}


def _ds_deepspeed() -> types.ModuleType:
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("ds's opt-in `deepspeed` package (packages/deepspeed) is not installed")
    if importlib.util.find_spec("deepspeed._alias") is None:
        pytest.skip("the installed `deepspeed` is not ds's alias package (Microsoft's DeepSpeed?)")
    return importlib.import_module("deepspeed")


def _resolve(path: str) -> types.ModuleType:
    """A module path as a user reaches it: imported, or as an attribute of its parent."""
    try:
        return importlib.import_module(path)
    except ImportError:
        head, _, name = path.rpartition(".")
        found = getattr(_resolve(head), name, None) if head else None
        if isinstance(found, types.ModuleType):
            return found
        raise


def _has(owner: Any, name: str) -> bool:
    """``hasattr`` that also takes a lazy ``__getattr__`` raising something else as "absent"."""
    try:
        getattr(owner, name)
    except Exception:  # e.g. ModuleNotFoundError from a lazy submodule
        return False
    return True


@dataclass
class ModuleReport:
    """One module path: whether ds provides it, and which of DeepSpeed's names it has."""

    path: str
    sources: list[str]
    present: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    used_by: dict[str, list[str]] = field(default_factory=dict)
    error: str | None = None  # ds has no such module, or it fails to import

    @property
    def total(self) -> int:
        return len(self.present) + len(self.missing)


def _reason(exc: Exception) -> str:
    if isinstance(exc, ModuleNotFoundError) and exc.name and exc.name.startswith("deepspeed"):
        return f"no module {exc.name} in ds"
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"[:200]


def check_module(path: str, entry: dict[str, Any]) -> ModuleReport:
    report = ModuleReport(path, entry["sources"], used_by=entry.get("used_by", {}))
    names = sorted(entry["names"])
    try:
        module = _resolve(path)
    except Exception as exc:  # a gap to report, whatever the failure
        report.error = _reason(exc)
        report.missing = names
        return report
    for name in names:
        (report.present if _has(module, name) else report.missing).append(name)
    return report


def _live_members_body(rank: int, world_size: int) -> dict[str, Any]:
    """``dir()`` of a real one-rank DeepSpeedEngine, PipelineEngine and accelerator."""
    import deepspeed
    import torch

    found: dict[str, Any] = {}
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {}}}
    builders = {
        "deepspeed.runtime.engine.DeepSpeedEngine": lambda: deepspeed.initialize(
            model=torch.nn.Linear(4, 4), config=config
        )[0],
        "deepspeed.runtime.pipe.engine.PipelineEngine": lambda: deepspeed.initialize(
            model=deepspeed.pipe.PipelineModule(
                layers=[torch.nn.Linear(4, 4)], num_stages=1, loss_fn=torch.nn.MSELoss()
            ),
            config=config,
        )[0],
        "deepspeed.accelerator.abstract_accelerator.DeepSpeedAccelerator": lambda: (
            deepspeed.accelerator.get_accelerator()
        ),
    }
    for path, build in builders.items():
        try:
            found[path] = sorted(set(dir(build())))
        except Exception as exc:  # reported: why no instance was checked
            found[path] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return found


def check_class(path: str, entry: dict[str, Any], live: list[str] | str) -> ModuleReport:
    """A class's members, looked up on ds's live object (or on ds's class if none was built)."""
    report = ModuleReport(path, ["class"], used_by=entry.get("used_by", {}))
    module_path, _, name = path.rpartition(".")
    try:
        klass = getattr(_resolve(module_path), name)
    except Exception as exc:  # reported
        klass, report.error = None, f"class not found ({_reason(exc)})"
    names = set(live) if isinstance(live, list) else set()
    if isinstance(live, str):
        report.error = f"{report.error + '; ' if report.error else ''}no instance: {live}"[:300]
    for member in sorted(entry["members"]):
        has = member in names or (klass is not None and _has(klass, member))
        (report.present if has else report.missing).append(member)
    return report


# -- the page ------------------------------------------------------------------------------------


def _names(names: list[str], used_by: dict[str, list[str]]) -> str:
    return ", ".join(
        f"`{n}` ({', '.join(used_by[n])})" if n in used_by else f"`{n}`" for n in names
    )


def _section(report: ModuleReport) -> list[str]:
    """A module's or class's missing names (a walked module ds lacks only gets its summary row)."""
    if report.error and not report.present and report.sources == ["walked"]:
        return []
    lines = [f"### `{report.path}`: {len(report.present)}/{report.total}", ""]
    if report.error:
        lines += [f"Not provided: {report.error}.", ""]
    if report.missing:
        label = "Missing" if report.present or not report.error else "Its names"
        lines += [f"{label}: {_names(report.missing, report.used_by)}", ""]
    return lines


def render(
    inventory: dict[str, Any], modules: list[ModuleReport], classes: list[ModuleReport]
) -> str:
    clients = ", ".join(f"{name} {version}" for name, version in inventory["clients"].items())
    names_ok = sum(len(r.present) for r in modules)
    names_all = sum(r.total for r in modules)
    paths_ok = sum(r.error is None for r in modules)
    lines = [
        f"# DeepSpeed {inventory['deepspeed_version']}'s surface in ds (generated)",
        "",
        "Generated by `integration/test_compat_surface.py` from `tools/compat/deepspeed_surface.json`,",
        "which `tools/compat/inventory.py` reads from a real DeepSpeed install. Do not edit by hand:",
        "run the test (`pytest integration/test_compat_surface.py`) to refresh it. The status of",
        "each item (the same, better, not implemented) is in [compat.md](compat.md).",
        "",
        f"**{paths_ok} of {len(modules)} module paths** import from ds's `deepspeed` package, and",
        f"**{names_ok} of {names_all} names** exist. A name followed by clients in parentheses is",
        "used by them. Clients scanned:",
        f"{clients}. Sources: `listed` (documentation and examples), `client` (imported by a",
        "client), `walked` (a submodule of `deepspeed.runtime`, `deepspeed.ops`, ...). Engine and",
        "accelerator members are looked up on real objects (a one-rank engine, `get_accelerator()`).",
        "",
        "## Summary",
        "",
        "| module | sources | present | missing names used by clients |",
        "|---|---|---|---|",
    ]
    for r in [*classes, *modules]:
        gaps = [n for n in r.missing if n in r.used_by]
        status = "not provided" if r.error and not r.present else f"{len(r.present)}/{r.total}"
        status += " (no instance)" if "no instance" in (r.error or "") else ""
        lines.append(
            f"| `{r.path}` | {', '.join(r.sources)} | {status} | {_names(gaps, r.used_by)} |"
        )
    lines += ["", "## Engine and accelerator members", ""]
    for r in classes:
        lines += _section(r)
    lines += ["## Modules", ""]
    for r in modules:
        lines += _section(r)
    return "\n".join(lines).rstrip() + "\n"


def _table(reports: list[ModuleReport]) -> str:
    width = max(len(r.path) for r in reports)
    rows = [f"{'module':<{width}}  present/total  status"]
    for r in reports:
        status = r.error or ("complete" if not r.missing else f"{len(r.missing)} missing")
        rows.append(f"{r.path:<{width}}  {len(r.present):>7}/{r.total:<5}  {status}")
    return "\n".join(rows)


def test_compat_surface_report() -> None:
    deepspeed = _ds_deepspeed()
    inventory = json.loads(INVENTORY.read_text())
    assert inventory["deepspeed_version"] == deepspeed.__version__ == "0.19.8"
    assert inventory["modules"] and inventory["classes"]
    modules = [check_module(path, entry) for path, entry in inventory["modules"].items()]
    (live,) = run_on_ranks(_live_members_body, 1, timeout=300)
    classes = [
        check_class(path, entry, live.get(path, "not built"))
        for path, entry in inventory["classes"].items()
    ]
    print("\n" + _table([*classes, *modules]))
    page = render(inventory, modules, classes)
    try:
        DOC.write_text(page)
    except OSError as exc:  # a read-only checkout: the table above is still the report
        print(f"could not write {DOC}: {exc}")
    assert all(f"`{r.path}`" in page for r in [*classes, *modules])
    by_path = {r.path: r for r in modules}
    lost = {
        path: [name for name in names if name not in by_path[path].present]
        for path, names in REQUIRED.items()
    }
    assert not any(lost.values()), f"names ds provided are gone: {lost}"
