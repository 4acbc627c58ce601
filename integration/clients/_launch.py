"""Launch one client scenario on 2 local ranks and collect what each rank wrote.

Shared by the tests (through ``conftest.py``) and by ``make_reference.py``: both run the same
command lines, so a reference measured under real DeepSpeed and a test run under ds differ only in
which ``deepspeed`` the interpreter imports.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORLD_SIZE = 2
TIMEOUT_S = 600

# name -> (script, its arguments, the scenario whose output it starts from, or None)
SCENARIOS: dict[str, tuple[str, tuple[str, ...], str | None]] = {
    "trainer_zero2": ("run_trainer.py", ("--scenario", "zero2"), None),
    "trainer_resume": ("run_trainer.py", ("--scenario", "resume"), "trainer_zero2"),
    "trainer_zero3": ("run_trainer.py", ("--scenario", "zero3"), None),
    "trainer_offload": ("run_trainer.py", ("--scenario", "offload"), None),
    "trainer_bf16": ("run_trainer.py", ("--scenario", "bf16"), None),
    "accelerate_plugin": ("run_accelerate.py", ("--mode", "plugin"), None),
    "accelerate_launch": ("run_accelerate.py", ("--mode", "launch"), None),
    "accelerate_zero3": ("run_accelerate.py", ("--mode", "launch"), None),
    "lightning_zero2": ("run_lightning.py", (), None),
}


# Scenarios run by `accelerate launch --config_file <file>` instead of torchrun.
LAUNCH_CONFIGS = {
    "accelerate_launch": "accelerate_zero2.yaml",
    "accelerate_zero3": "accelerate_zero3.yaml",
}


class ScenarioFailed(RuntimeError):
    """A scenario's launcher exited non-zero; the message holds each rank's first traceback."""


@dataclass
class ScenarioRun:
    """What one scenario left: per-rank results, its folder and the launcher's output."""

    name: str
    out: Path
    results: list[dict[str, Any]]
    log: str
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def losses(self) -> list[list[float]]:
        """Per-rank, per-step losses: ``losses[rank][step]``."""
        return [result["losses"] for result in self.results]


def clean_env() -> dict[str, str]:
    """The environment every rank runs in: CPU, one thread, nothing fetched from a hub."""
    env = dict(os.environ)
    env.update(
        DS_ACCELERATOR="cpu",
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        PYTHONHASHSEED="0",
    )
    return env


def free_port() -> int:
    """A TCP port nobody listens on now, for the launcher's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def command(name: str, out: Path, start_from: Path | None, python: str) -> list[str]:
    """The command line that runs scenario ``name`` on ``WORLD_SIZE`` local ranks."""
    script, args, _ = SCENARIOS[name]
    tail = [str(HERE / script), *args, "--out", str(out)]
    if start_from is not None:
        tail += ["--resume-from", str(start_from / "trainer" / "checkpoint-10")]
    port = str(free_port())
    if name in LAUNCH_CONFIGS:
        launch = [python, "-m", "accelerate.commands.accelerate_cli", "launch"]
        config = str(HERE / LAUNCH_CONFIGS[name])
        return [*launch, "--config_file", config, "--main_process_port", port, *tail]
    run = [python, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD_SIZE}"]
    return [*run, "--master_addr=127.0.0.1", f"--master_port={port}", *tail]


def first_tracebacks(log: str, limit: int = 6000) -> str:
    """Each rank's first traceback out of a launcher's mixed output (the cause, not the echo)."""
    lines = log.splitlines()
    picked: list[str] = []
    seen: set[str] = set()
    for index, line in enumerate(lines):
        prefix = re.match(r"^(\[rank\d+\]:\s*)?Traceback", line)
        if prefix is None or (prefix.group(1) or "") in seen:
            continue
        seen.add(prefix.group(1) or "")
        block = [line]
        for follow in lines[index + 1 :]:
            block.append(follow)
            if re.match(r"^(\[rank\d+\]:\s*)?\w[\w.]*(Error|Exception|Failed)\b", follow):
                break
        picked.extend(block[-40:])
    text = "\n".join(picked) if picked else log[-limit:]
    return text[-limit:]


def run_scenario(
    name: str, out: Path, start_from: Path | None = None, python: str = sys.executable
) -> ScenarioRun:
    """Run scenario ``name`` into folder ``out``; raise ScenarioFailed with the ranks' tracebacks."""
    out.mkdir(parents=True, exist_ok=True)
    argv = command(name, out, start_from, python)
    began = time.monotonic()
    proc = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
        env=clean_env(),
        cwd=out,
    )
    seconds = time.monotonic() - began
    log = proc.stdout + proc.stderr
    (out / "launcher.log").write_text(log)
    if proc.returncode != 0:
        raise ScenarioFailed(
            f"scenario {name} exited {proc.returncode} after {seconds:.0f}s "
            f"(full log: {out / 'launcher.log'}):\n{first_tracebacks(log)}"
        )
    results = []
    for rank in range(WORLD_SIZE):
        path = out / f"result.rank{rank}.json"
        if not path.exists():
            raise ScenarioFailed(
                f"scenario {name}: rank {rank} wrote no {path.name}\n{log[-3000:]}"
            )
        results.append(json.loads(path.read_text()))
    return ScenarioRun(name=name, out=out, results=results, log=log, seconds=seconds)
