"""The exit hook stops ds-comm's hang watchdog before interpreter finalization (see [Note: the
hang watchdog at interpreter exit] in ``_exit.py``): a watchdog thread still inside a store call
then aborted the process ("terminate called without an active exception")."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from ds_testing import run_on_ranks


def _stop_body(rank: int, world_size: int) -> dict[str, Any]:
    from ds_comm import _exit, _forensics

    _forensics.arm(poll_s=0.01)
    thread = _forensics._WATCHDOG.thread
    stopped = _exit.stop_watchdog()
    return {
        "stopped": stopped,
        "alive": thread.is_alive(),
        "armed": _forensics._WATCHDOG is not None,
        "again": _exit.stop_watchdog(),
    }


def test_stop_watchdog_joins_the_thread() -> None:
    (result,) = run_on_ranks(_stop_body, 1)
    assert result == {"stopped": True, "alive": False, "armed": False, "again": False}


def test_importing_ds_comm_registers_the_watchdog_hook() -> None:
    # The interpreter's exit runs the hook, which disarms (here: a recorder) the watchdog.
    code = (
        "import ds_comm\n"
        "from ds_comm import _forensics\n"
        "_forensics.disarm = lambda: print('disarmed at exit')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "disarmed at exit"


_WATCHDOG_AT_EXIT = textwrap.dedent(
    """
    import os
    import socket
    import time

    import torch.multiprocessing as mp


    def rank_fn(rank, port):
        os.environ.update(
            RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        import ds_comm
        from ds_comm import _forensics

        ds_comm.init_distributed("gloo")
        _forensics.arm(poll_s=0.002)  # nearly always inside a store call
        ds_comm.barrier()
        if rank == 1:
            time.sleep(0.3)  # rank 0, the store's server, has exited by now


    if __name__ == "__main__":
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = str(sock.getsockname()[1])
        mp.spawn(rank_fn, args=(port,), nprocs=2)
        print("clean exit")
    """
)


@pytest.mark.slow
def test_ranks_exiting_with_a_busy_watchdog_exit_cleanly(tmp_path) -> None:
    # Without the hook this script aborted in 1 of 3 runs on the development machine (rank 1,
    # its watchdog inside c10d::Store::check); with it, in none of 5.
    script = tmp_path / "watchdog_at_exit.py"
    script.write_text(_WATCHDOG_AT_EXIT)
    for attempt in range(4):
        proc = subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert proc.returncode == 0 and "clean exit" in proc.stdout, (attempt, proc.stderr)
        assert "terminate called" not in proc.stderr
