"""Checkpoint metadata read and written with errors that name the file: sealed JSON manifests
(their own CRC-32 inside, so an edit is refused), fsynced atomic JSON writes, and ``torch.load``
of checkpoint files (weights only, never code).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ds_zero._checksums import crc32 as _crc32

__all__ = [
    "CheckpointError",
    "check_seal",
    "load_file",
    "read_json",
    "read_sealed_manifest",
    "seal",
    "write_json_atomic",
]

_SEAL = "manifest_crc32"


class CheckpointError(ValueError):
    """A checkpoint directory that is incomplete, corrupted or does not fit the optimizer."""


def _canonical(manifest: Mapping[str, Any]) -> bytes:
    body = {k: v for k, v in manifest.items() if k != _SEAL}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def seal(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """``manifest`` with its own CRC-32 added (an edited manifest is then refused)."""
    return {**manifest, _SEAL: _crc32(_canonical(manifest))}


def check_seal(manifest: Mapping[str, Any], path: Path) -> None:
    """Raise :class:`CheckpointError` unless ``manifest`` (read from ``path``) is sealed and
    unchanged."""
    if _SEAL not in manifest:
        raise CheckpointError(
            f"{path} has no {_SEAL}: written by an older ds or by hand, so its entries cannot be "
            "trusted; save the checkpoint again with this version"
        )
    if manifest[_SEAL] != _crc32(_canonical(manifest)):
        raise CheckpointError(
            f"{path} was changed after it was written (its {_SEAL} does not match its "
            "contents): the checkpoint cannot be trusted"
        )


def read_json(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in ``path``; a :class:`CheckpointError` naming the file and what is wrong
    with it otherwise (``what`` says what the file is)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{what} {str(path)!r} does not exist") from None
    except OSError as exc:
        raise CheckpointError(f"{what} {str(path)!r} cannot be read: {exc}") from None
    if not raw:
        raise CheckpointError(f"{what} {str(path)!r} is empty (0 bytes): the write did not finish")
    try:
        loaded = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise CheckpointError(
            f"{what} {str(path)!r} is not UTF-8 JSON text (byte {exc.start} of {len(raw)})"
        ) from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(
            f"{what} {str(path)!r} is not valid JSON ({exc.msg} at line {exc.lineno} column "
            f"{exc.colno}, {len(raw)} bytes): truncated or overwritten"
        ) from None
    if not isinstance(loaded, dict):
        raise CheckpointError(
            f"{what} {str(path)!r} holds a {type(loaded).__name__}, not an object"
        )
    return loaded


def load_file(path: Path, *, mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU; a :class:`CheckpointError` naming the
    file and the reason when it is absent, truncated or not a checkpoint file."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {str(path)!r} does not exist")
    try:
        return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except Exception as exc:  # torch raises OSError, RuntimeError or UnpicklingError
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"checkpoint file {str(path)!r} ({path.stat().st_size} bytes) cannot be read: it is "
            f"truncated, corrupted or not a torch.save file ({type(exc).__name__}: {reason})"
        ) from None


def write_json_atomic(obj: Any, path: Path) -> None:
    """Write ``obj`` as JSON through a fsynced temporary file and a rename."""
    temp = path.with_name(f".{path.name}.tmp")
    with open(temp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, path)


def read_sealed_manifest(
    path: Path, expected_format: str, reader: str, missing: str
) -> dict[str, Any]:
    """A sealed manifest file: ``missing`` as the error when absent, then its format (``reader``
    names what reads it) and its seal checked (a :class:`CheckpointError` otherwise)."""
    if not path.is_file():
        raise CheckpointError(missing)
    manifest = read_json(path, "checkpoint manifest")
    if manifest.get("format") != expected_format:
        raise CheckpointError(
            f"{path} has format {manifest.get('format')!r}; {reader} reads {expected_format!r}"
        )
    check_seal(manifest, path)
    return manifest
