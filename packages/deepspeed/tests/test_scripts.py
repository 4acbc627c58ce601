"""The ``deepspeed`` and ``ds_report`` console scripts."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path


def _script(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent))
    assert found is not None, f"console script {name!r} is not installed next to {sys.executable}"
    return found


def test_entry_points() -> None:
    scripts = {
        ep.name: ep.value
        for ep in importlib.metadata.distribution("deepspeed").entry_points
        if ep.group == "console_scripts"
    }
    assert scripts == {
        "deepspeed": "ds_launch.cli:main",
        "ds_report": "ds_engine.env_report:cli_main",
    }


def test_deepspeed_command_is_the_launcher() -> None:
    out = subprocess.run(
        [_script("deepspeed"), "--help"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert "--num_gpus" in out.stdout and "--hostfile" in out.stdout


def test_ds_report_lists_ops_then_environment() -> None:
    out = subprocess.run([_script("ds_report")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "cpu_adam" in out.stdout and "transformer_inference" in out.stdout
    assert "not implemented in ds" in out.stdout  # the reason, not hidden
    assert "ds environment report" in out.stdout
    hidden = subprocess.run(
        [_script("ds_report"), "--hide_operator_status"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert hidden.returncode == 0 and "cpu_adam" not in hidden.stdout


def test_python_m_runs_the_aliased_launcher_modules() -> None:
    # accelerate and DeepSpeed's own docs start nodes with `python -m deepspeed.launcher.launch`.
    for module, flag in (
        ("deepspeed.launcher.runner", "--num_gpus"),
        ("deepspeed.launcher.launch", "--world_info"),
    ):
        out = subprocess.run(
            [sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr
        assert flag in out.stdout
