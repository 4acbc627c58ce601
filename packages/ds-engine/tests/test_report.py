"""``ds-report``: the environment table, its hints, and that no broken component crashes it."""

from __future__ import annotations

import importlib.metadata

import pytest

from ds_engine._report import Check, _guarded, collect, format_report, main


def test_report_lists_python_torch_backends_and_packages() -> None:
    checks = {c.name: c for c in collect()}
    for name in ("python", "torch", "CUDA", "NCCL", "torch.distributed gloo", "ds-engine"):
        assert name in checks
    assert checks["torch.distributed gloo"].ok
    assert checks["ds-engine"].detail == importlib.metadata.version("ds-engine")
    assert all(c.hint for c in checks.values() if not c.ok)  # every NO says what to do
    for name in ("native kernels (ds-native)", "libaio (ds-offload-aio)", "triton"):
        assert name in checks


def test_a_failing_probe_becomes_a_no_with_its_hint() -> None:
    def broken() -> tuple[bool, str]:
        raise OSError("libfoo.so: cannot open shared object file")

    check = _guarded("foo", "apt-get install libfoo", broken)
    assert not check.ok and "libfoo.so" in check.detail and check.hint == "apt-get install libfoo"
    table = format_report([Check("bar", True, "1.0"), check])
    assert "bar  [OKAY]  1.0" in table
    assert "[NO]" in table and "-> apt-get install libfoo" in table


def test_console_script_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    (script,) = importlib.metadata.entry_points(group="console_scripts", name="ds-report")
    assert script.load() is main
    assert main() == 0
    out = capsys.readouterr().out
    assert "ds environment report" in out and "[OKAY]" in out
