"""Checkpoint metadata read and written with errors that name the file: sealed JSON manifests
(their own CRC-32 inside, so an edit is refused; see [Note: the manifest's two seals]), written
fsynced through a rename, and ``torch.load`` of checkpoint files (weights only, never code).
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
    "read_sealed",
    "read_sealed_manifest",
    "seal",
    "write_sealed",
]

_SEAL = "manifest_crc32"
_RAW_SEAL = "manifest_seal"

# Note: the manifest's two seals
# ------------------------------
# A manifest is sealed by a CRC-32 of its contents, so an edited manifest is refused. The first
# seal, ``manifest_crc32``, is the CRC-32 of the manifest's canonical JSON (sorted keys, no
# spaces): checking it means encoding the parsed manifest again, which took 0.15 ms for a
# 10M-parameter ZeRO-3 checkpoint's 13 KB ``ds_manifest.json`` on the development VM, and twice
# that on the loading thread while the checksum threads ran, about 2% of that load for the two
# manifests. So the manifest is written compact, in its own key order, followed by a second
# seal over those very bytes, then the first:
#
#     {"format":...,"files":{...},"manifest_seal":R,"manifest_crc32":C}
#
# ``R`` is the CRC-32 of the bytes before ``,"manifest_seal"`` with ``}`` appended (the
# manifest's compact JSON), checked on the bytes as read, without encoding anything. ``C`` is
# the canonical seal of the manifest with ``manifest_seal`` in it, so a reader of the first
# seal alone (ds-zero 0.3.0 and older) accepts the file too. A manifest passes when either seal
# holds: the second for one written so, the first for an older one or one re-indented by hand.
# A changed byte of the contents fails both (``C`` covers ``R``); a changed byte of ``C`` alone
# is refused by older readers and passes here, where ``C`` guards nothing that is used. The
# key order is kept (not sorted), since the universal manifest's tensors are in the model's
# order, which its readers use.


class CheckpointError(ValueError):
    """A checkpoint directory that is incomplete, corrupted or does not fit the optimizer."""


def _canonical(manifest: Mapping[str, Any]) -> bytes:
    body = {k: v for k, v in manifest.items() if k != _SEAL}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def seal(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """``manifest`` with its own CRC-32 added (an edited manifest is then refused)."""
    return {**manifest, _SEAL: _crc32(_canonical(manifest))}


def sealed_bytes(manifest: Mapping[str, Any]) -> bytes:
    """``manifest`` as the bytes of its file: compact JSON in its own key order, then both
    seals (see [Note: the manifest's two seals])."""
    body = json.dumps(
        {k: v for k, v in manifest.items() if k not in (_SEAL, _RAW_SEAL)}, separators=(",", ":")
    ).encode()
    if body == b"{}":
        raise ValueError("an empty manifest cannot be sealed")
    raw_seal = _crc32(body)
    canonical = seal({**manifest, _RAW_SEAL: raw_seal})[_SEAL]
    return body[:-1] + f',"{_RAW_SEAL}":{raw_seal},"{_SEAL}":{canonical}}}'.encode()


def _raw_seal_holds(raw: bytes, manifest: Mapping[str, Any]) -> bool:
    """Whether ``raw``, the bytes ``manifest`` was parsed from, end in the two seals and the
    second one is the CRC-32 of the bytes before them."""
    raw_seal = manifest.get(_RAW_SEAL)
    if type(raw_seal) is not int:
        return False
    at = raw.rfind(f',"{_RAW_SEAL}":'.encode())
    tail = f',"{_RAW_SEAL}":{raw_seal},"{_SEAL}":{manifest.get(_SEAL)}}}'.encode()
    return at > 0 and raw[at:].rstrip() == tail and _crc32(raw[:at] + b"}") == raw_seal


def check_seal(manifest: Mapping[str, Any], path: Path) -> None:
    """Raise :class:`CheckpointError` unless ``manifest`` (read from ``path``) is sealed and
    unchanged, by its canonical seal (see [Note: the manifest's two seals])."""
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
    return _parse(_read_bytes(path, what), path, what)


def read_sealed(path: Path, what: str) -> dict[str, Any]:
    """The sealed JSON object in ``path``, its seal checked (see [Note: the manifest's two
    seals]); a :class:`CheckpointError` naming the file and what is wrong with it otherwise."""
    raw = _read_bytes(path, what)
    manifest = _parse(raw, path, what)
    _check_either_seal(raw, manifest, path)
    return manifest


def _check_either_seal(raw: bytes, manifest: Mapping[str, Any], path: Path) -> None:
    if not _raw_seal_holds(raw, manifest):
        check_seal(manifest, path)


def _read_bytes(path: Path, what: str) -> bytes:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{what} {str(path)!r} does not exist") from None
    except OSError as exc:
        raise CheckpointError(f"{what} {str(path)!r} cannot be read: {exc}") from None
    if not raw:
        raise CheckpointError(f"{what} {str(path)!r} is empty (0 bytes): the write did not finish")
    return raw


def _parse(raw: bytes, path: Path, what: str) -> dict[str, Any]:
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


def write_sealed(manifest: Mapping[str, Any], path: Path) -> None:
    """Write ``manifest`` sealed (see [Note: the manifest's two seals]) through a fsynced
    temporary file and a rename."""
    data = sealed_bytes(manifest)
    temp = path.with_name(f".{path.name}.tmp")
    with open(temp, "wb") as f:
        f.write(data)
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
    raw = _read_bytes(path, "checkpoint manifest")
    manifest = _parse(raw, path, "checkpoint manifest")
    if manifest.get("format") != expected_format:
        raise CheckpointError(
            f"{path} has format {manifest.get('format')!r}; {reader} reads {expected_format!r}"
        )
    _check_either_seal(raw, manifest, path)
    return manifest
