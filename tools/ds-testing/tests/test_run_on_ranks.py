"""Results, arguments, environment and worker reuse of ``run_on_ranks`` (real processes)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Any

import pytest

from ds_testing import DistributedTestFailure, preload, run_on_ranks


def _all_reduce_body(rank: int, world_size: int, *, scale: float = 1.0) -> float:
    import torch
    import torch.distributed as dist

    assert dist.get_rank() == rank and dist.get_world_size() == world_size
    t = torch.ones(3) * rank * scale
    dist.all_reduce(t)
    return float(t[0])


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_all_reduce_results_are_indexed_by_rank(world_size: int) -> None:
    results = run_on_ranks(_all_reduce_body, world_size, scale=2.0)
    expected = 2.0 * sum(range(world_size))
    assert results == [expected] * world_size


def _echo_body(rank: int, world_size: int, *args: Any, **kwargs: Any) -> dict[str, Any]:
    import torch

    return {"rank": rank, "args": args, "kwargs": kwargs, "tensor": torch.arange(3) + rank}


def test_args_kwargs_and_tensors_round_trip() -> None:
    import torch

    results = run_on_ranks(_echo_body, 2, 1, "two", flag=True, nested={"a": [1, 2]})
    for rank, result in enumerate(results):
        assert result["rank"] == rank
        assert result["args"] == (1, "two")
        assert result["kwargs"] == {"flag": True, "nested": {"a": [1, 2]}}
        assert torch.equal(result["tensor"], torch.arange(3) + rank)


def _env_body(rank: int, world_size: int, name: str) -> tuple[str | None, str | None]:
    return os.environ.get(name), os.environ.get("OMP_NUM_THREADS")


def test_env_is_set_for_one_call_only() -> None:
    with_env = run_on_ranks(_env_body, 2, "DS_TESTING_PROBE", env={"DS_TESTING_PROBE": "on"})
    assert with_env == [("on", "1"), ("on", "1")]
    assert run_on_ranks(_env_body, 2, "DS_TESTING_PROBE") == [(None, "1"), (None, "1")]


def _pid_body(rank: int, world_size: int) -> int:
    return os.getpid()


def test_workers_are_reused_between_calls() -> None:
    first = run_on_ranks(_pid_body, 2)
    assert len(set(first)) == 2 and os.getpid() not in first
    assert run_on_ranks(_pid_body, 2) == first


def test_fresh_uses_one_off_workers() -> None:
    shared = run_on_ranks(_pid_body, 2)
    one_off = run_on_ranks(_pid_body, 2, fresh=True)
    assert set(one_off).isdisjoint(shared)
    assert run_on_ranks(_pid_body, 2) == shared


def _destroy_group_body(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    dist.destroy_process_group()


def test_destroyed_default_group_is_reinitialised() -> None:
    run_on_ranks(_destroy_group_body, 2)
    assert run_on_ranks(_all_reduce_body, 2) == [1.0, 1.0]


def _env_init_body(rank: int, world_size: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    assert not dist.is_initialized()
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {name: os.environ[name] for name in names}
    dist.init_process_group("gloo", init_method="env://")
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return {**env, "sum": float(t[0])}


def test_without_process_group_env_init_works() -> None:
    results = run_on_ranks(_env_init_body, 2, init_process_group=False, fresh=True)
    for rank, env in enumerate(results):
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert int(env["MASTER_PORT"]) > 0
        assert env["sum"] == 2.0
    assert results[0]["MASTER_PORT"] == results[1]["MASTER_PORT"]


def test_concurrent_calls_from_threads_do_not_clash() -> None:
    results: dict[str, Any] = {}

    def call(name: str, world_size: int, fresh: bool) -> None:
        try:
            results[name] = run_on_ranks(_all_reduce_body, world_size, fresh=fresh)
        except BaseException as exc:  # reported by the assertion below
            results[name] = exc

    threads = [
        threading.Thread(target=call, args=("shared", 2, False)),
        threading.Thread(target=call, args=("fresh", 2, True)),
        threading.Thread(target=call, args=("four", 4, False)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert results == {"shared": [1.0, 1.0], "fresh": [1.0, 1.0], "four": [6.0] * 4}


def test_rejects_non_module_level_functions() -> None:
    def local_body(rank: int, world_size: int) -> None:
        return None

    with pytest.raises(ValueError, match="module-level"):
        run_on_ranks(local_body, 1)


def test_failure_is_an_assertion_error() -> None:
    assert issubclass(DistributedTestFailure, AssertionError)


_PRELOAD_SCRIPT = """
import sys

from ds_testing import preload, run_on_ranks


def body(rank, world_size):
    return "tabnanny" in sys.modules


if __name__ == "__main__":
    preload("tabnanny")
    print(run_on_ranks(body, 2))
"""


def _imports_tabnanny(rank: int, world_size: int) -> bool:
    return "tabnanny" in sys.modules


def test_preloaded_modules_are_imported_before_the_workers_fork(tmp_path) -> None:
    """``preload`` (from a conftest) makes the fork server import a module once, so each worker
    starts with it; without it no worker has it; a different list once the fork server runs is
    an error naming the fix."""
    script = tmp_path / "preloading.py"
    script.write_text(_PRELOAD_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "DS_TESTING_FORK_SERVER"}
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[True, True]"
    assert run_on_ranks(_imports_tabnanny, 2) == [False, False]  # nothing here preloads it
    with pytest.raises(RuntimeError, match=r"call it from the suite's conftest\.py"):
        preload("tabnanny")
