"""Sealed manifests: written compact with a seal over their bytes, read without encoding them
again, and still read (and readable by older ds) through the canonical seal (see ds-zero's
[Note: the manifest's two seals])."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds_zero import _sealed
from ds_zero._sealed import CheckpointError, check_seal, read_sealed, seal, write_sealed

MANIFEST = {
    "format": "ds.test/1",
    "files": {
        "b.pt": {"bytes": 10, "crc32": [7], "tensors": {"z": {"offset": 3, "shape": [2]}}},
        "a.pt": {"bytes": 5, "crc32": [9], "tensors": {"y": {"offset": 0, "shape": []}}},
    },
    "note": 'ünïcode and "quotes"',
    "scale": 0.1,
}


def _written(tmp_path: Path) -> Path:
    path = tmp_path / "manifest.json"
    write_sealed(MANIFEST, path)
    return path


def _body(manifest: dict) -> dict:
    return {k: v for k, v in manifest.items() if k not in ("manifest_seal", "manifest_crc32")}


def test_a_written_manifest_reads_back_in_its_own_key_order(tmp_path: Path) -> None:
    read = read_sealed(_written(tmp_path), "manifest")
    assert _body(read) == MANIFEST
    assert list(read["files"]) == ["b.pt", "a.pt"]  # not sorted: the universal manifest's
    assert list(read)[-2:] == ["manifest_seal", "manifest_crc32"]  # tensors keep model order
    assert not list(tmp_path.glob(".*.tmp"))


def test_its_seal_is_checked_on_the_bytes_without_encoding_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _written(tmp_path)

    def no_encoding(manifest: object) -> bytes:
        raise AssertionError("the manifest was encoded again to check its seal")

    monkeypatch.setattr(_sealed, "_canonical", no_encoding)
    assert _body(read_sealed(path, "manifest")) == MANIFEST


def test_an_older_reader_accepts_it(tmp_path: Path) -> None:
    """ds-zero 0.3.0 and older check the canonical seal alone (``check_seal`` on the parsed
    file); they must not call a manifest written now corrupted."""
    path = _written(tmp_path)
    check_seal(json.loads(path.read_bytes()), path)


@pytest.mark.parametrize("indent", [None, 1], ids=["compact", "indented"])
def test_a_manifest_sealed_the_old_way_or_reindented_is_read_by_its_canonical_seal(
    tmp_path: Path, indent: int | None
) -> None:
    old = tmp_path / "old.json"
    old.write_text(json.dumps(seal(MANIFEST), indent=indent))
    assert _body(read_sealed(old, "manifest")) == MANIFEST
    reindented = tmp_path / "reindented.json"
    reindented.write_text(json.dumps(json.loads(_written(tmp_path).read_bytes()), indent=2))
    assert _body(read_sealed(reindented, "manifest")) == MANIFEST


def test_every_changed_byte_is_refused_or_changes_nothing(tmp_path: Path) -> None:
    """Each byte of the file in turn, changed to each of a few others: the read is refused
    with an error naming the file, or (a byte of the canonical seal's digits, which guards
    nothing here) gives the manifest unchanged."""
    path = _written(tmp_path)
    good = path.read_bytes()
    refused = unchanged = 0
    for at in range(len(good)):
        for new in {b"0", b"1", b" ", b"x", b"}"} - {good[at : at + 1]}:
            path.write_bytes(good[:at] + new + good[at + 1 :])
            try:
                read = read_sealed(path, "manifest")
            except CheckpointError as exc:
                assert str(path) in str(exc)
                refused += 1
                continue
            assert _body(read) == MANIFEST, (at, new)
            assert good.rindex(b'"manifest_crc32":') < at, (at, new)
            unchanged += 1
    assert refused > 4 * len(good) - 50 and unchanged < 50


def test_anything_after_the_seals_is_refused(tmp_path: Path) -> None:
    path = _written(tmp_path)
    good = path.read_bytes()
    path.write_bytes(good[:-1] + b',"extra":1}')
    with pytest.raises(CheckpointError, match="changed after it was written"):
        read_sealed(path, "manifest")


def test_an_empty_manifest_is_not_written(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="empty manifest"):
        write_sealed({}, tmp_path / "manifest.json")
    assert not list(tmp_path.iterdir())
