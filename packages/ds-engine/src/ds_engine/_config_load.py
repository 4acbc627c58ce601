"""Reading a config: a mapping, an HJSON/JSON file, or a base64-encoded JSON string.

DeepSpeed reads config files with ``hjson`` (a superset of JSON: comments, trailing commas,
unquoted keys) and refuses duplicate keys; ds reads them the same way, after trying plain JSON
(which also reads ``Infinity``, what ``json.dumps`` writes for ``steps_per_print = inf``); a string that is not a path is decoded as URL-safe
base64 (what ``deepspeed --deepspeed_config`` receives from launchers that inline the config).
"""

from __future__ import annotations

import base64
import binascii
import copy
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import hjson

from ds_comm import ConfigError

__all__ = ["load_config_dict", "parse_config_text"]


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` that refuses a key given twice in one object."""
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ConfigError(
                f"Duplicate keys in DeepSpeed config: {key!r} appears twice in one object; keep "
                "one of them"
            )
        seen[key] = value
    return seen


def parse_config_text(text: str, *, source: str) -> dict[str, Any]:
    """Parse HJSON (or JSON) text into a dict; ``source`` names it in errors.

    Example:
        >>> parse_config_text('{train_batch_size: 8, /* comment */ }', source="inline")
        {'train_batch_size': 8}
    """
    try:  # JSON first: it also reads Infinity (json.dumps of steps_per_print = inf)
        loaded = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError:
        try:
            loaded = hjson.loads(text, object_pairs_hook=_no_duplicates)
        except hjson.HjsonDecodeError as exc:
            raise ConfigError(f"{source} is not valid JSON or HJSON: {exc}") from exc
    if not isinstance(loaded, Mapping):
        raise ConfigError(f"{source}: expected a JSON object at the top level")
    return _plain(loaded)


def _plain(value: Any) -> Any:
    """hjson's ordered dicts as plain dicts (all the way down)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _decode_base64(text: str) -> str | None:
    """The UTF-8 text ``text`` encodes in (URL-safe) base64, or None when it is not base64."""
    compact = "".join(text.split())
    if not compact:
        return None
    padded = compact + "=" * (-len(compact) % 4)
    try:
        raw = base64.urlsafe_b64decode(padded.encode("ascii"))
        return raw.decode("utf-8")
    except (binascii.Error, UnicodeError, ValueError):
        return None


def _read_text(path: Path) -> str:
    """The UTF-8 text of a config file, or a ConfigError naming the file when it is not text."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {str(path)!r} is not a UTF-8 text file (byte {exc.start} is "
            f"{raw[exc.start]:#04x}); pass a JSON or HJSON file"
        ) from None


def load_config_dict(config: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    """A config as a dict, from a mapping (deep-copied), a file path (HJSON, as DeepSpeed reads
    it; duplicate keys are errors) or a base64-encoded JSON string.

    Raises:
        ConfigError: no such file and not base64, invalid JSON/HJSON, duplicate keys, or a
            top level that is not an object.

    Example:
        >>> load_config_dict(base64.urlsafe_b64encode(b'{"train_batch_size": 8}').decode())
        {'train_batch_size': 8}
    """
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if not isinstance(config, (str, os.PathLike)):
        raise ConfigError(
            f"config = {config!r}: expected a dict, the path of a JSON/HJSON file or a "
            "base64-encoded JSON string"
        )
    path = Path(config)
    if path.is_file():
        return parse_config_text(_read_text(path), source=f"config file {str(path)!r}")
    decoded = _decode_base64(str(config)) if isinstance(config, str) else None
    if decoded is not None and decoded.lstrip().startswith("{"):
        return parse_config_text(decoded, source="the base64-encoded config")
    raise ConfigError(
        f"config = {str(config)!r}: no such JSON file, and not a base64-encoded JSON object; "
        "pass a dict, an existing path, or base64 of a JSON object"
    )
