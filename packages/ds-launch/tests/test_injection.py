"""Launcher input cannot inject: hostile host names are refused by every runner before anything
runs (naming the hostfile line), pdsh's ``%h`` stays one quoted word even for a name that got
through, and values with spaces and shell characters reach the ranks intact through a real remote
shell (sshd on a loopback port, see conftest). See [Note: names that cannot inject]."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ds_launch import LaunchConfig, LaunchError, plan_launch
from ds_launch.cli import main

RUNNERS = ("ssh", "pdsh", "openmpi", "mpich", "impi", "mvapich", "slurm")
# Each runs `touch MARKER` if a shell ever evaluates it (no spaces or '=': the hostfile parser
# must take them as a host name, so the name check is what refuses them).
HOSTILE = (
    "w3;touch${IFS}{m}",
    "w3$(touch${IFS}{m})",
    "w3`touch${IFS}{m}`",
    "w3|touch${IFS}{m}",
    "w3&touch${IFS}{m}",
    "-oProxyCommand",  # an ssh option; in pdsh's -w list, "exclude this host"
    "w3&&touch${IFS}{m}",
)


def _hostile(template: str, marker: Path) -> str:
    return template.replace("{m}", str(marker))


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("runner", RUNNERS)
def test_hostile_hostfile_names_are_refused_with_the_line(runner, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    marker = tmp_path / "marker"
    for template in HOSTILE:
        host = _hostile(template, marker)
        hostfile = tmp_path / "hostfile"
        hostfile.write_text(f"w1 slots=1\n{host} slots=1\nw2 slots=1\n")
        for dry in (["--dry_run"], []):
            code, out, err = _cli(
                f"--hostfile={hostfile}", f"--launcher={runner}", *dry, "train.py"
            )
            assert code == 2, (host, out, err)
            assert f"{hostfile}:2: '{host} slots=1': '{host}' is refused" in err, err
            assert out == ""
        assert not marker.exists(), host


@pytest.mark.parametrize("flag", ["--include", "--exclude", "--master_addr"])
def test_hostile_names_in_flags_are_refused(flag, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    marker = tmp_path / "marker"
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("w1 slots=1\nw2 slots=1\n")
    for runner in RUNNERS:
        for template in HOSTILE:
            value = _hostile(template, marker)
            code, out, err = _cli(
                f"--hostfile={hostfile}", f"--launcher={runner}", f"{flag}={value}",
                "--dry_run", "train.py",
            )  # fmt: skip
            assert code == 2 and out == "", (runner, value, err)
            assert f"{value!r} is refused" in err, err
    assert not marker.exists()


def test_api_pools_and_world_info_are_checked_too(tmp_path):
    from ds_launch import select_resources
    from ds_launch._nodespec import decode_world_info, encode_world_info

    for template in HOSTILE:
        host = _hostile(template, tmp_path / "m")
        with pytest.raises(LaunchError, match="is refused"):
            select_resources({"w1": [0], host: [0]})
        with pytest.raises(LaunchError, match=r"--world_info: host .* is refused"):
            decode_world_info(encode_world_info({"w1": [0], host: [0]}))
    # Valid names of every kind pass: names, FQDNs, IPv4, IPv6, underscores.
    good = {"w-1": [0], "node.example.com": [0], "10.0.0.7": [0], "fe80::1": [0], "a_b": [0]}
    assert select_resources(good) == good


def test_env_file_names_must_be_variable_names(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".deepspeed_env").write_text("GOOD=1\n-u=x\n")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("w1 slots=1\nw2 slots=1\n")
    config = LaunchConfig(user_script="t.py", hostfile=str(hostfile), launcher="ssh")
    with pytest.raises(LaunchError, match=r"\.deepspeed_env:2: '-u=x': '-u' is not a variable"):
        plan_launch(config, {}, cwd=str(tmp_path))


def test_pdsh_host_substitution_stays_one_quoted_word(tmp_path, monkeypatch):
    # Even a name that skipped every check cannot leave its quotes once pdsh substitutes %h:
    # the node command, run by a real shell as pdsh would, starts the agent with the name as
    # one argument (which it then refuses), and the marker is never created.
    monkeypatch.setenv("HOME", str(tmp_path))
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("w1 slots=1\nw2 slots=1\n")
    config = LaunchConfig(
        user_script="train.py", hostfile=str(hostfile), launcher="pdsh", user_args=("50%",)
    )
    plan = plan_launch(config, {"PATH": "/usr/bin:/bin"}, cwd=str(tmp_path))
    remote = plan.commands[0][-1]
    marker = tmp_path / "marker"
    for template in HOSTILE:
        host = _hostile(template, marker)
        command = remote.replace("%h", host).replace("%%", "%")  # pdsh's substitution
        result = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=60)
        assert not marker.exists(), (host, command)
        assert result.returncode == 2, (host, result.stderr)
        assert "is refused" in result.stderr, result.stderr
    assert "--node_host='%h'" in remote


# Values a remote shell would split, expand or run if they were not quoted; pdsh's %-escapes too.
QUOTED_VALUE = "  two  spaces $(touch {m}) `touch {m}` ; | & 'sq' \"dq\" %h %% \\ * $HOME"
QUOTED_ARG = "x= lead;touch {m} && echo $((1+1)) 'it''s' %h"


def _runner_flags(runner: str, sshd, hostfile: Path) -> tuple[list[str], dict[str, str]]:
    flags = [f"--hostfile={hostfile}", f"--launcher={runner}", f"--ssh_port={sshd.port}"]
    if runner == "ssh":
        return [*flags, "--launcher_args", sshd.options], {}
    return flags, {"PDSH_SSH_ARGS_APPEND": sshd.options}


@pytest.mark.parametrize(
    "runner",
    [
        pytest.param("ssh", marks=pytest.mark.slow),
        "pdsh",
        pytest.param("mpich", marks=pytest.mark.slow),
    ],
)
def test_values_with_spaces_reach_the_ranks_intact(launcher, sshd, out_dir, tmp_path, runner):
    marker = tmp_path / "marker"
    value = QUOTED_VALUE.replace("{m}", str(marker))
    arg = QUOTED_ARG.replace("{m}", str(marker))
    # .deepspeed_env strips the value's outer blanks (as DeepSpeed does): compare with that.
    (tmp_path / ".deepspeed_env").write_text(f"DSTEST_QUOTED={value}\n")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.1 slots=1\nlocalhost slots=1\n")
    if runner == "mpich":
        flags, extra = ["--launcher=mpich", "--force_multi", "--num_gpus=2"], {}
        extra["CUDA_VISIBLE_DEVICES"] = ""
    else:
        flags, extra = _runner_flags(runner, sshd, hostfile)
    env = launcher.env(**extra, HOME=str(tmp_path / "home"), NCCL_DSTEST_SPACES=value)
    result = launcher.run(*flags, *launcher.program("report", out_dir, arg), cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in range(2):
        res = json.loads((out_dir / f"rank{rank}.json").read_text())
        assert res["dstest"]["DSTEST_QUOTED"] == value.strip()
        assert res["dstest"]["NCCL_DSTEST_SPACES"] == value
        assert res["args"] == [arg]
    assert not marker.exists()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__]))
