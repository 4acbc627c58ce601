"""Fixtures of the ds-launch tests: run the real ``ds-launch`` script, read the process table, and
a throwaway sshd on a loopback port for the ssh and pdsh runners."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

RANK_PROGRAM = Path(__file__).with_name("rank_program.py")
# Generous: the machine running these is shared, and every rank imports torch.
TIMEOUT_S = 240
# Launch variables of the pytest process must not reach the launcher (ranks get their own).
_STRIP = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_STRIP_PREFIXES = ("OMPI_", "PMI_", "PMIX_", "SLURM_", "HYDRA_", "CROSS_", "DSTEST")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in _STRIP and not k.startswith(_STRIP_PREFIXES)
    }
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def processes_with(token: str) -> list[tuple[int, str]]:
    """Live processes whose command line holds ``token`` (zombies included: not yet reaped)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if token.encode() in cmdline:
            found.append((int(entry), cmdline.replace(b"\0", b" ").decode(errors="replace")))
    return found


@dataclass
class Launcher:
    """Runs the installed ``ds-launch`` console script."""

    exe: str
    token: str

    def run(
        self, *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = TIMEOUT_S
    ) -> subprocess.CompletedProcess[str]:
        proc = self.start(*args, cwd=cwd, env=env)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"ds-launch {' '.join(args)} timed out; stdout:\n{out}\nstderr:\n{err}")
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def start(
        self, *args: str, cwd: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [self.exe, *args],
            cwd=cwd,
            env=clean_env() if env is None else env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # signals from the test reach only the launcher
        )

    program_path = RANK_PROGRAM

    def program(self, mode: str, out_dir: Path, *options: str) -> list[str]:
        """The rank program's arguments (after the ds-launch flags)."""
        return [str(RANK_PROGRAM), mode, str(out_dir), self.token, *options]

    @staticmethod
    def env(**extra: str) -> dict[str, str]:
        """This process's environment without launch variables, plus ``extra``."""
        return clean_env(**extra)

    @staticmethod
    def free_port() -> int:
        return free_port()

    def assert_no_leftovers(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while (left := processes_with(self.token)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, f"processes left behind: {left}"


@pytest.fixture
def launcher() -> Iterator[Launcher]:
    exe = Path(sys.executable).with_name("ds-launch")
    assert exe.exists(), f"no ds-launch console script next to {sys.executable}"
    helper = Launcher(str(exe), f"dstest-{uuid.uuid4().hex}")
    yield helper
    for pid, _ in processes_with(helper.token):  # never leak into the next test
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    path = tmp_path / "out"
    path.mkdir()
    return path


@dataclass(frozen=True)
class SshServer:
    port: int
    options: str  # ssh options selecting the throwaway key, never touching ~/.ssh


def _tool(name: str, *extra_dirs: str) -> str:
    found = shutil.which(name) or next(
        (os.path.join(d, name) for d in extra_dirs if os.path.exists(os.path.join(d, name))),
        None,
    )
    if found is None:
        # tools/setup/system-deps.sh installs these before the nox session: not a skip.
        pytest.fail(f"{name} is not installed (run tools/setup/system-deps.sh)")
    return found


def _wait_listening(proc: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"sshd exited with {proc.returncode}:\n{log.read_text()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    pytest.fail(f"sshd did not listen on port {port}:\n{log.read_text()}")


@pytest.fixture(scope="session")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshServer]:
    """An sshd on a free loopback port, as the current user, with a throwaway key pair."""
    sshd_bin = _tool("sshd", "/usr/sbin", "/usr/local/sbin")
    keygen = _tool("ssh-keygen")
    home = tmp_path_factory.mktemp("sshd")
    for key in ("host_key", "user_key"):
        subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(home / key)], check=True)
    authorized = home / "authorized_keys"
    authorized.write_text((home / "user_key.pub").read_text())
    authorized.chmod(0o600)
    port = free_port()
    config = home / "sshd_config"
    config.write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {home / 'host_key'}\n"
        f"AuthorizedKeysFile {authorized}\nPidFile {home / 'sshd.pid'}\n"
        "UsePAM no\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "PubkeyAuthentication yes\nPermitRootLogin prohibit-password\nStrictModes no\n"
    )
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation dir
    log = home / "sshd.log"
    with open(log, "w") as log_fd:
        proc = subprocess.Popen(
            [sshd_bin, "-D", "-e", "-f", str(config)],
            stdout=log_fd,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait_listening(proc, port, log)
        options = (
            f"-i {home / 'user_key'} -o IdentitiesOnly=yes -o StrictHostKeyChecking=no "
            "-o UserKnownHostsFile=/dev/null -o LogLevel=ERROR -o AddressFamily=inet"
        )
        yield SshServer(port, options)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
