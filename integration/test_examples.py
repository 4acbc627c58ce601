"""Every config in tools/examples/*/configs trains through ``ds-launch`` exactly as its example's
README says, on 2 local ranks, and the loss rank 0 prints falls (slow tier).

The command is read from the README's code block: the part from ``ds-launch`` on, with the
README's config replaced by each shipped one. The README's prefix (``pip install uv`` and
``uv run --locked``) only sets up this environment, so ``ds-launch`` is this venv's console script.
The one flag added is ``--master_port`` with a free port, so that a concurrent job on the default
port (29500) cannot make the run fail.
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import socket
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = sorted(ROOT.glob("tools/examples/*/configs/*.json"))
FINAL_LINE = re.compile(r"^\[rank0\] rank 0 of 2: loss ([\d.]+) -> ([\d.]+)", re.MULTILINE)


def readme_command(example: pathlib.Path) -> list[str]:
    """The README's ``ds-launch`` command line, from ``ds-launch`` on."""
    text = (example / "README.md").read_text()
    lines = [
        line for line in text.splitlines() if "ds-launch" in line and "--deepspeed_config" in line
    ]
    assert len(lines) == 1, f"{example}/README.md: expected one ds-launch command, got {lines}"
    words = shlex.split(lines[0].split("&&")[-1])
    return words[words.index("ds-launch") :]


def with_config(command: list[str], config: pathlib.Path) -> list[str]:
    """``command`` with its ``--deepspeed_config`` value replaced by ``config``."""
    at = command.index("--deepspeed_config") + 1
    return [*command[:at], str(config.relative_to(ROOT)), *command[at + 1 :]]


def test_the_readme_command_is_found() -> None:
    command = readme_command(ROOT / "tools" / "examples" / "gpt")
    assert command[:3] == ["ds-launch", "--num_gpus", "2"]
    assert with_config(command, CONFIGS[0])[-1] == str(CONFIGS[0].relative_to(ROOT))


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: f"{p.parents[1].name}-{p.stem}")
def test_every_example_config_trains_as_documented(config: pathlib.Path) -> None:
    command = with_config(readme_command(config.parents[1]), config)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    launcher = str(pathlib.Path(sys.executable).parent / "ds-launch")
    command = [launcher, f"--master_port={port}", *command[1:]]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        command, capture_output=True, text=True, timeout=1200, check=False, env=env, cwd=ROOT
    )
    output = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, output
    match = FINAL_LINE.search(proc.stdout)
    assert match is not None, output
    first, last = float(match.group(1)), float(match.group(2))
    assert last < 0.8 * first, output
