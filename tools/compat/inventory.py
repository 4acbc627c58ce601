"""Inventory of DeepSpeed's public surface, read from a real DeepSpeed install.

Run it with Microsoft's DeepSpeed importable (not ds's ``deepspeed`` alias), on any machine:

    DS_ACCELERATOR=cpu /tmp/dsref/bin/python tools/compat/inventory.py

It writes ``tools/compat/deepspeed_surface.json``: for each module path that users and clients
import, the public names it holds and their kinds; for DeepSpeed's engines and accelerator
class, their methods, properties and instance attributes; and which of those names the installed
clients (transformers, accelerate, Lightning) use. ``integration/test_compat_surface.py`` checks
ds's ``deepspeed`` package against the file and writes ``docs/compat-surface.md``.

[Note: what counts as public]
Modules come from three sources, recorded per module: ``listed`` (the paths DeepSpeed's
documentation and examples import, below), ``client`` (every ``deepspeed.*`` path the installed
clients import or reach by attribute, found by parsing their source), and ``walked`` (the direct
submodules of the packages in ``WALKED``, skipping ``_private`` ones). A module's names are its
``__all__`` when it has one. Otherwise they are its non-underscore attributes, minus what it merely
imported from elsewhere: names its source imports from outside ``deepspeed``, classes and functions
defined outside ``deepspeed``, modules that are not its own submodules (the top-level
``deepspeed`` namespace may hold any DeepSpeed module), and ``typing`` constructs. Constants and objects (``logger``) are kept. A class's surface is what its
DeepSpeed-defined classes (not ``torch.nn.Module``) define, public names plus the underscore names
the clients call, and the ``self.<name> =`` assignments in their source (instance attributes).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.metadata
import inspect
import json
import os
import pkgutil
import sys
import textwrap
import types
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "deepspeed_surface.json"

# Paths DeepSpeed's documentation, tutorials and DeepSpeedExamples import.
LISTED = (
    "deepspeed",
    "deepspeed.accelerator",
    "deepspeed.checkpoint",
    "deepspeed.checkpoint.utils",
    "deepspeed.checkpointing",
    "deepspeed.comm",
    "deepspeed.launcher.launch",
    "deepspeed.launcher.runner",
    "deepspeed.moe",
    "deepspeed.moe.layer",
    "deepspeed.moe.utils",
    "deepspeed.monitor",
    "deepspeed.monitor.monitor",
    "deepspeed.ops",
    "deepspeed.ops.adam",
    "deepspeed.ops.aio",
    "deepspeed.ops.lamb",
    "deepspeed.ops.op_builder",
    "deepspeed.pipe",
    "deepspeed.profiling",
    "deepspeed.profiling.flops_profiler",
    "deepspeed.runtime",
    "deepspeed.runtime.activation_checkpointing.checkpointing",
    "deepspeed.runtime.config",
    "deepspeed.runtime.dataloader",
    "deepspeed.runtime.engine",
    "deepspeed.runtime.fp16.loss_scaler",
    "deepspeed.runtime.lr_schedules",
    "deepspeed.runtime.pipe.engine",
    "deepspeed.runtime.pipe.module",
    "deepspeed.runtime.pipe.schedule",
    "deepspeed.runtime.pipe.topology",
    "deepspeed.runtime.utils",
    "deepspeed.runtime.zero",
    "deepspeed.runtime.zero.config",
    "deepspeed.runtime.zero.offload_config",
    "deepspeed.runtime.zero.partition_parameters",
    "deepspeed.runtime.zero.stage3",
    "deepspeed.runtime.zero.stage_1_and_2",
    "deepspeed.utils",
    "deepspeed.utils.groups",
    "deepspeed.utils.zero_to_fp32",
    "deepspeed.zero",
)
# Packages whose direct submodules are all listed (deepspeed.runtime.*, deepspeed.ops.*, ...).
WALKED = (
    "deepspeed.checkpoint",
    "deepspeed.comm",
    "deepspeed.monitor",
    "deepspeed.moe",
    "deepspeed.ops",
    "deepspeed.profiling",
    "deepspeed.runtime",
    "deepspeed.runtime.activation_checkpointing",
    "deepspeed.runtime.checkpoint_engine",
    "deepspeed.runtime.fp16",
    "deepspeed.runtime.pipe",
    "deepspeed.runtime.zero",
    "deepspeed.utils",
)
CLASSES = (
    "deepspeed.runtime.engine.DeepSpeedEngine",
    "deepspeed.runtime.pipe.engine.PipelineEngine",
    "deepspeed.accelerator.abstract_accelerator.DeepSpeedAccelerator",
)
# Distributions whose source is scanned for the deepspeed names they use (import name -> dist).
CLIENTS = {
    "transformers": "transformers",
    "accelerate": "accelerate",
    "lightning": "lightning",
    "pytorch_lightning": "pytorch-lightning",
}
_TYPING = ("typing", "typing_extensions", "collections.abc")
# What clients call their engine; an underscore attribute read on one of these names is an engine
# name the clients depend on when an engine class defines it.
ENGINE_NAMES = frozenset(
    {
        "engine",
        "model",
        "model_wrapped",
        "wrapped_model",
        "deepspeed",
        "deepspeed_engine",
        "ds_engine",
    }
)


def _is_deepspeed(name: str | None) -> bool:
    return bool(name) and (name == "deepspeed" or name.startswith("deepspeed."))


def _kind(owner: str, name: str, obj: Any) -> str | None:
    """The kind of ``owner.name`` if it is part of ``owner``'s own surface, else None."""
    if isinstance(obj, types.ModuleType):
        mine = obj.__name__ == f"{owner}.{name}" or (
            owner == "deepspeed" and _is_deepspeed(obj.__name__)
        )
        return "module" if mine else None
    if inspect.isclass(obj) or inspect.isroutine(obj):
        return (
            ("class" if inspect.isclass(obj) else "function")
            if _is_deepspeed(getattr(obj, "__module__", None))
            else None
        )
    if type(obj).__module__ in _TYPING or getattr(obj, "__module__", None) in _TYPING:
        return None
    if isinstance(
        obj, (bool, int, float, str, bytes, tuple, list, dict, set, frozenset, type(None))
    ):
        return "constant"
    return "object"


def foreign_imports(module: types.ModuleType) -> set[str]:
    """Names the module's source binds by importing from outside ``deepspeed`` (``REMAINDER``
    from argparse, ``Optional``...): not its surface, whatever their type."""
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError, SyntaxError):
        return set()
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and not _is_deepspeed(node.module):
            found |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {
                alias.asname or alias.name.partition(".")[0]
                for alias in node.names
                if not _is_deepspeed(alias.name)
            }
    return found


def module_names(module: types.ModuleType) -> dict[str, str]:
    """``{name: kind}`` of a module's public surface (see [Note: what counts as public])."""
    explicit = getattr(module, "__all__", None)
    foreign = foreign_imports(module) if explicit is None else set()
    names: dict[str, str] = {}
    for name in explicit if explicit is not None else dir(module):
        if explicit is None and (name.startswith("_") or name in foreign):
            continue
        if not hasattr(module, name):
            names[name] = "missing"  # listed in __all__ but absent: still part of the contract
            continue
        kind = _kind(module.__name__, name, getattr(module, name))
        if kind is not None or explicit is not None:
            names[name] = kind or "object"
    return dict(sorted(names.items()))


def walked_modules(packages: tuple[str, ...]) -> list[str]:
    """The direct, non-private submodules of each package."""
    found = []
    for package in packages:
        try:
            path = importlib.import_module(package).__path__
        except (ImportError, AttributeError):
            continue
        for info in pkgutil.iter_modules(path):
            if not info.name.startswith(("_", "test")):  # DeepSpeed's own tests are no surface
                found.append(f"{package}.{info.name}")
    return found


def resolve(path: str) -> types.ModuleType:
    """The module at a dotted path: imported, or reached by attribute (``deepspeed.zero`` is
    ``deepspeed.runtime.zero``, and ``import deepspeed.zero`` fails in DeepSpeed too).

    Raises:
        ImportError: neither works; the message is the import's.
    """
    try:
        return importlib.import_module(path)
    except ImportError as exc:
        head, _, name = path.rpartition(".")
        if head:
            try:
                found = getattr(resolve(head), name)
            except (ImportError, AttributeError):
                raise exc from None
            if isinstance(found, types.ModuleType):
                return found
        raise


# -- the clients ---------------------------------------------------------------------------------


class _ClientUses(ast.NodeVisitor):
    """``deepspeed`` paths one source file imports or reaches by attribute."""

    def __init__(self) -> None:
        self.aliases: dict[str, str] = {}  # local name -> deepspeed dotted path
        self.paths: set[str] = set()  # dotted paths used: modules, or module.name
        self.private: set[str] = set()  # underscore attributes of what looks like an engine

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if _is_deepspeed(alias.name):
                self.paths.add(alias.name)
                local = alias.asname or alias.name.partition(".")[0]
                self.aliases[local] = alias.name if alias.asname else "deepspeed"

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0 and _is_deepspeed(node.module):
            for alias in node.names:
                if alias.name != "*":
                    self.paths.add(f"{node.module}.{alias.name}")
                    self.aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain = []
        current: ast.expr = node
        while isinstance(current, ast.Attribute):
            chain.append(current.attr)
            current = current.value
        if isinstance(current, ast.Name) and current.id in self.aliases:
            self.paths.add(".".join([self.aliases[current.id], *reversed(chain)]))
        elif node.attr.startswith("_") and not node.attr.startswith("__"):
            receiver = node.value
            last = (
                receiver.attr
                if isinstance(receiver, ast.Attribute)
                else getattr(receiver, "id", "")
            )
            if last in ENGINE_NAMES:
                self.private.add(node.attr)
        self.generic_visit(node)


def _client_files(package: str) -> list[Path]:
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    root = Path(next(iter(spec.submodule_search_locations)))
    return sorted(p for p in root.rglob("*.py") if "deepspeed" in p.read_text(errors="replace"))


def scan_clients() -> tuple[dict[str, str], dict[str, set[str]], dict[str, set[str]]]:
    """Client versions, ``{dotted path: clients}`` and ``{underscore attribute: clients}``."""
    versions, paths, private = {}, defaultdict(set), defaultdict(set)
    for package, dist in CLIENTS.items():
        files = _client_files(package)
        if not files:
            continue
        versions[package] = importlib.metadata.version(dist)
        for path in files:
            visitor = _ClientUses()
            try:
                visitor.visit(ast.parse(path.read_text(errors="replace")))
            except SyntaxError:
                continue
            for used in visitor.paths:
                paths[used].add(package)
            for attr in visitor.private:
                private[attr].add(package)
    return versions, paths, private


def split_path(dotted: str) -> tuple[str, str | None]:
    """``deepspeed.a.b.name`` -> (the longest importable module prefix, the next name or None)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            resolve(module)
        except Exception:  # any failure: not a module path
            continue
        return module, parts[cut] if cut < len(parts) else None
    return dotted, None


# -- classes -------------------------------------------------------------------------------------


def _instance_attributes(klass: type) -> set[str]:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
    except (OSError, TypeError, SyntaxError):
        return set()
    found = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for target in targets:
            if (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
            ):
                found.add(target.attr)
    return found


def class_surface(path: str, client_private: dict[str, set[str]]) -> dict[str, Any]:
    """Methods, properties and instance attributes of a DeepSpeed class and its DeepSpeed bases."""
    module_name, _, class_name = path.rpartition(".")
    klass = getattr(importlib.import_module(module_name), class_name)
    own = [k for k in klass.__mro__ if _is_deepspeed(k.__module__)]
    defined: dict[str, str] = {}
    for base in reversed(own):
        for name, value in vars(base).items():
            if isinstance(value, property):
                defined[name] = "property"
            elif inspect.isroutine(value) or isinstance(value, (staticmethod, classmethod)):
                defined[name] = "method"
            else:
                defined[name] = "attribute"
        for name in _instance_attributes(base):
            defined.setdefault(name, "instance attribute")

    def public(name: str) -> bool:
        return not name.startswith("_") or (not name.startswith("__") and name in client_private)

    members = {n: k for n, k in sorted(defined.items()) if public(n)}
    used = {n: sorted(client_private[n]) for n in members if n.startswith("_")}
    return {"bases": [k.__qualname__ for k in own], "members": members, "used_by": used}


# -- the inventory -------------------------------------------------------------------------------


def _module_entry(name: str, sources: set[str], uses: dict[str, set[str]]) -> dict[str, Any]:
    entry: dict[str, Any] = {"sources": sorted(sources)}
    try:
        module = resolve(name)
    except Exception as exc:  # recorded; the walk goes on
        entry["import_error"] = f"{type(exc).__name__}: {exc}"[:300]
        entry["names"] = {}
        return entry
    if module.__name__ != name:
        entry["attribute_of_parent"] = module.__name__  # reached as an attribute, not imported
    names = module_names(module)
    used_by: dict[str, list[str]] = {}
    for dotted, clients in uses.items():
        head, _, tail = dotted.rpartition(".")
        if head == name and tail:
            if tail not in names and hasattr(module, tail):
                names[tail] = _kind(name, tail, getattr(module, tail)) or "object"
            used_by[tail] = sorted(clients)
    entry["names"] = dict(sorted(names.items()))
    entry["used_by"] = dict(sorted(used_by.items()))
    return entry


def build_inventory() -> dict[str, Any]:
    """The whole inventory (see the module docstring)."""
    import deepspeed

    versions, paths, private = scan_clients()
    sources: dict[str, set[str]] = defaultdict(set)
    for name in LISTED:
        sources[name].add("listed")
    for name in walked_modules(WALKED):
        sources[name].add("walked")
    uses: dict[str, set[str]] = defaultdict(set)
    for dotted, clients in paths.items():
        module, name = split_path(dotted)
        sources[module].add("client")
        if name is not None:
            uses[f"{module}.{name}"] |= clients
    modules = {name: _module_entry(name, sources[name], uses) for name in sorted(sources)}
    return {
        "deepspeed_version": deepspeed.__version__,
        "generated_by": "tools/compat/inventory.py",
        "clients": versions,
        "modules": modules,
        "classes": {path: class_surface(path, private) for path in CLASSES},
    }


def _check_real_deepspeed() -> None:
    import deepspeed

    if "ds_engine" in sys.modules or not hasattr(deepspeed, "git_hash"):
        sys.exit(f"{deepspeed.__file__} is not Microsoft's DeepSpeed; run with its venv")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON file to write")
    args = parser.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    _check_real_deepspeed()
    inventory = build_inventory()
    args.out.write_text(json.dumps(inventory, indent=1, sort_keys=True) + "\n")
    count = sum(len(m["names"]) for m in inventory["modules"].values())
    print(f"{args.out}: {len(inventory['modules'])} modules, {count} names, {len(CLASSES)} classes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
