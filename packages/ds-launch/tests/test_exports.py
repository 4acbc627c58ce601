"""Which variables every rank receives: launcher variables by prefix and ``.deepspeed_env`` files
(current directory, then home; ``DS_ENV_FILE``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ds_launch import LaunchConfig, LaunchError, plan_launch


@pytest.fixture
def dirs(tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    cwd, home = tmp_path / "work", tmp_path / "home"
    cwd.mkdir()
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    return cwd, home


def _exports(cwd: Path, environ: dict[str, str], **kwargs) -> dict[str, str]:
    config = LaunchConfig(user_script="t.py", num_gpus=1, **kwargs)
    return plan_launch(config, {"CUDA_VISIBLE_DEVICES": "", **environ}, cwd=str(cwd)).exports


def test_prefixed_variables_are_exported_and_launch_variables_never(dirs):
    cwd, _ = dirs
    environ = {
        "NCCL_SOCKET_IFNAME": "eth0",
        "PYTHONPATH": "/opt/lib",
        "PYTHONHASHSEED": "0",
        "UCX_TLS": "rc",
        "FI_PROVIDER": "efa",
        "MV2_USE_CUDA": "1",
        "MLFLOW_TRACKING_URI": "http://m",
        "NCCLX": "not a prefix match",
        "RANK": "3",
        "HOME_DIR": "x",
    }
    assert _exports(cwd, environ) == {
        "FI_PROVIDER": "efa",
        "MLFLOW_TRACKING_URI": "http://m",
        "MV2_USE_CUDA": "1",
        "NCCL_SOCKET_IFNAME": "eth0",
        "PYTHONHASHSEED": "0",
        "PYTHONPATH": "/opt/lib",
        "UCX_TLS": "rc",
    }


def test_env_files_home_then_current_directory_which_wins(dirs):
    cwd, home = dirs
    (home / ".deepspeed_env").write_text("A=home\nB = from home \n")
    (cwd / ".deepspeed_env").write_text("# comment\n\nA=cwd=with=equals\nNCCL_X=file\n")
    exports = _exports(cwd, {"NCCL_X": "env"})
    assert exports == {"NCCL_X": "file", "A": "cwd=with=equals", "B": "from home"}


def test_ds_env_file_names_a_path_or_a_file_name(dirs):
    cwd, home = dirs
    other = cwd.parent / "job.env"
    other.write_text("JOB=1\n")
    (cwd / ".deepspeed_env").write_text("IGNORED=1\n")
    assert _exports(cwd, {"DS_ENV_FILE": str(other)}) == {"JOB": "1"}
    (home / "team.env").write_text("TEAM=1\n")
    assert _exports(cwd, {"DS_ENV_FILE": "team.env"}) == {"TEAM": "1"}
    with pytest.raises(LaunchError, match=r"DS_ENV_FILE=nope\.env: no such file"):
        _exports(cwd, {"DS_ENV_FILE": "nope.env"})


def test_malformed_env_file_line_names_file_and_line(dirs):
    cwd, _ = dirs
    path = cwd / ".deepspeed_env"
    path.write_text("GOOD=1\nexport BAD VALUE\n")
    with pytest.raises(LaunchError) as info:
        _exports(cwd, {})
    assert str(info.value) == f"{path}:2: 'export BAD VALUE' is not NAME=VALUE"


def test_multi_node_runs_put_the_launch_directory_on_pythonpath(dirs, tmp_path):
    cwd, _ = dirs
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=1\nb slots=1\n")
    exports = _exports(cwd, {"PYTHONPATH": "/opt/lib"}, hostfile=str(hostfile))
    assert exports["PYTHONPATH"] == f"{cwd}:/opt/lib"


def test_aisc_nodes_keep_their_own_network_variables(dirs):
    cwd, _ = dirs
    environ = {"NCCL_IB_HCA": "mlx5_0", "UCX_NET_DEVICES": "mlx5_0:1", "NCCL_DEBUG": "INFO"}
    assert _exports(cwd, environ) == environ
    assert _exports(cwd, {**environ, "AISC_JOB_NAME": "job"}) == {"NCCL_DEBUG": "INFO"}
