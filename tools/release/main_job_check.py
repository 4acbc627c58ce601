"""A new user's path, end to end: plain pip installs ds-engine from the wheelhouse, then the
README's main job runs with what it installed.

In a fresh ``python -m venv`` (no shared torch layer: pip installs torch itself),
``pip install --find-links dist ds-engine`` gets the whole runtime (the checks of
``pip_install_check.py`` apply), then that venv's ``ds-launch`` trains the example GPT with ZeRO
stage 2 on 2 local CPU ranks, exactly as the README's main job does, and the loss must fall.

Run from the repository root after ``nox -s build``: ``python tools/release/main_job_check.py``
(``--job-only``: run the job again in the venv the last run installed).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from pip_install_check import Checker

JOB = [
    "--num_gpus",
    "2",
    "tools/examples/gpt/train.py",
    "--deepspeed_config",
    "tools/examples/gpt/configs/zero2.json",
]


def _free_port() -> int:
    """A port nothing listens on now (the default 29500 may be another job's on a shared host)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    bin_dir = Path("build/main-job/ds-engine/bin").resolve()
    if "--job-only" not in args or not (bin_dir / "ds-launch").is_file():
        checker = Checker(Path("dist"), Path("build/main-job"), fresh=True)
        if problems := checker.check("ds-engine"):
            print(f"ds-engine does not install alone: {problems}", file=sys.stderr)
            return 1
    job = ["--master_port", str(_free_port()), *JOB]
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "OMP_NUM_THREADS": "1",
    }
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    print(f"$ ds-launch {' '.join(job)}", flush=True)
    proc = subprocess.run(
        [bin_dir / "ds-launch", *job], env=env, capture_output=True, text=True, timeout=900
    )
    print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n", flush=True)
    match = re.search(r"rank 0 of 2: loss ([\d.]+) -> ([\d.]+)", proc.stdout)
    if proc.returncode != 0 or match is None:
        print(f"the main job failed (exit {proc.returncode})", file=sys.stderr)
        return 1
    first, last = float(match.group(1)), float(match.group(2))
    if not last < first:
        print(f"the loss did not fall: {first} -> {last}", file=sys.stderr)
        return 1
    print(f"main job on the pip-installed ds-engine: loss {first} -> {last}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
