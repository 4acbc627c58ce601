"""The README's main job: ds-launch trains the example GPT with ZeRO stage 2 on 2 local ranks.

Runs the real command line (the ``ds-launch`` console script of this venv, the example script,
its shipped config), with fewer steps, and checks that the job really ran data parallel on 2 ranks
and that the loss rank 0 reports at the end fell.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "tools" / "examples" / "gpt"
FINAL_LINE = re.compile(r"^\[rank0\] rank 0 of 2: loss ([\d.]+) -> ([\d.]+)", re.MULTILINE)


def test_ds_launch_trains_the_example_on_two_ranks() -> None:
    launcher = pathlib.Path(sys.executable).parent / "ds-launch"
    command = [
        str(launcher),
        "--num_gpus",
        "2",
        str(EXAMPLE / "train.py"),
        "--deepspeed_config",
        str(EXAMPLE / "configs" / "zero2.json"),
        "--steps",
        "30",
    ]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        command, capture_output=True, text=True, timeout=300, check=False, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "over 2 data-parallel ranks" in proc.stdout, proc.stdout[-3000:]
    match = FINAL_LINE.search(proc.stdout)
    assert match is not None, proc.stdout[-3000:]
    first, last = float(match.group(1)), float(match.group(2))
    assert last < 0.8 * first
