"""The small files of a checkpoint (rng state, client state, manifests), hashed on the loading
thread at the verdict in one read each: every change to one is refused naming the file and
what happened to it, and an intact directory passes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ds_zero import CheckpointError, _integrity, start_verification, verify_directory
from ds_zero._integrity import write_directory_manifest


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-7])


def _append(path: Path) -> None:
    path.write_bytes(path.read_bytes() + b"\0")


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "flipped": (_flip, "corrupted"),
    "truncated": (_truncate, "truncated"),
    "appended": (_append, "grew after the save"),
    "deleted": (Path.unlink, "absent"),
}
FILES = ("rng_state_rank00000.pt", "client_state.json")


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    folder = tmp_path / "step5"
    folder.mkdir()
    torch.save({"cpu_rng_state": torch.arange(300, dtype=torch.uint8)}, folder / FILES[0])
    (folder / FILES[1]).write_text('{"epoch": 3, "note": "' + "x" * 500 + '"}')
    write_directory_manifest(folder)
    return folder


@pytest.fixture
def small_path(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The files checked by the loading thread's one-read check (not by the checksum threads)."""
    checked: list[str] = []
    original = _integrity.small_file_problem

    def recording(directory, name, record, chunk):
        checked.append(name)
        return original(directory, name, record, chunk)

    monkeypatch.setattr(_integrity, "small_file_problem", recording)
    return checked


def test_an_intact_directory_passes_checked_on_the_loading_thread(
    checkpoint: Path, small_path: list[str]
) -> None:
    with start_verification(checkpoint) as pending:
        manifest = pending.wait()
    assert set(manifest["files"]) == set(FILES)
    assert sorted(small_path) == sorted(FILES)


@pytest.mark.parametrize("file", FILES)
@pytest.mark.parametrize("kind", DAMAGE)
def test_each_change_is_refused_naming_the_file_and_the_change(
    checkpoint: Path, small_path: list[str], file: str, kind: str
) -> None:
    damage, said = DAMAGE[kind]
    damage(checkpoint / file)
    with pytest.raises(CheckpointError) as pending_error, start_verification(checkpoint) as pending:
        pending.wait()
    assert f"{file} {said}" in str(pending_error.value)
    assert file in small_path
    with pytest.raises(CheckpointError) as whole_error:  # the check done at once agrees
        verify_directory(checkpoint)
    assert f"{file} {said}" in str(whole_error.value)
