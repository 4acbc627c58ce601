"""Hostfile parsing: the format, and errors that name the file and the line."""

from __future__ import annotations

from pathlib import Path

import pytest

from ds_launch import HostfileError, LaunchError, parse_hostfile


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "hostfile"
    path.write_text(text)
    return str(path)


def test_hosts_in_file_order_with_comments_and_blank_lines(tmp_path):
    path = _write(
        tmp_path,
        "# cluster A\n\nworker-2 slots=4\n   worker-1   slots=8   # the big one\n\n"
        "10.0.0.7 slots = 2\n",
    )
    pool = parse_hostfile(path)
    assert pool == {"worker-2": 4, "worker-1": 8, "10.0.0.7": 2}
    assert list(pool) == ["worker-2", "worker-1", "10.0.0.7"]


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        ("worker-1 slots=4\nworker-2 4\n", 2, "'worker-2 4' is not `hostname slots=N`"),
        ("worker-1\n", 1, "'worker-1' is not `hostname slots=N`"),
        ("w1 slots=2\n# c\nw1 slots=4\n", 3, "host 'w1' is listed again (first on line 1)"),
        ("w1 slots=four\n", 1, "slots=four for 'w1' is not a positive integer"),
        ("w1 slots=-2\n", 1, "slots=-2 for 'w1' is not a positive integer"),
        ("\nw1 slots=0\n", 2, "slots=0 for 'w1': give it >= 1 slot or remove the line"),
        ("w1 slots=1 max_slots=2\n", 1, "is not `hostname slots=N`"),
    ],
    ids=["no-slots-key", "host-only", "duplicate", "non-integer", "negative", "zero", "extra"],
)
def test_malformed_lines_name_file_and_line(tmp_path, text, line, message):
    path = _write(tmp_path, text)
    with pytest.raises(HostfileError) as info:
        parse_hostfile(path)
    assert str(info.value).startswith(f"{path}:{line}: ")
    assert message in str(info.value)
    assert (info.value.path, info.value.line) == (path, line)


def test_empty_and_missing_files_are_errors(tmp_path):
    path = _write(tmp_path, "# nothing but comments\n\n")
    with pytest.raises(HostfileError, match="no hosts"):
        parse_hostfile(path)
    with pytest.raises(LaunchError, match="does not exist"):
        parse_hostfile(str(tmp_path / "missing"))
