"""Crash safety of ``save_checkpoint``, tested the way a database tests its write-ahead log: a
save is killed at each of its file-system calls in turn (``_crash_points.crash_at``: open,
write, flush, close, fsync, mkdir, rename, replace, unlink, rmdir, torch.save ...), and every
time a load afterwards must give exactly the old checkpoint's values or exactly the new one's,
never an error and never a mix. Tags reused ("latest-only" saving) and new tags, ZeRO-2 and
ZeRO-3.

The default tier enumerates every kill point of a one-rank save in-process (the kill is a
:class:`~_crash_points.Crash` exception nothing in ds catches, which leaves the files as a kill
would: nothing after the call happens) plus the two-rank kill the issue reported; the slow tier
kills real two-rank saves (``os._exit`` in forked ranks) at every call of either rank.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _crash_points import Crash, crash_at
from _engine_testing import config, loss_of, make_dataset, make_mlp


def _engine(stage: int, seed: int = 0):
    import ds_engine

    cfg = config(zero_optimization={"stage": stage}, seed=3)
    engine, *_ = ds_engine.initialize(model=make_mlp(seed), config=cfg)
    return engine


def _train(engine, steps: int, rank: int) -> None:
    data = make_dataset(64)
    for step in range(steps):
        at = 8 * step + 4 * rank
        engine.backward(loss_of(engine, [t[at : at + 4] for t in data.tensors]))
        engine.step()


def _fingerprint(engine) -> dict[str, Any]:
    """Everything a load restores that the test compares: weights, counters, client state."""
    from ds_zero import GatheredParameters

    params = list(engine.module.parameters())
    with GatheredParameters(params):
        weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {"weights": weights, "global_steps": engine.global_steps}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["global_steps"] == b["global_steps"] and all(
        torch.equal(a["weights"][n], b["weights"][n]) for n in a["weights"]
    )


def _which(engine, root: Path, old: dict, new: dict) -> str:
    """Load ``root`` into ``engine`` and say whether it holds the old or the new values."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, client = engine.load_checkpoint(str(root))
    got = _fingerprint(engine)
    recovered = any("is missing" in str(w.message) for w in caught)
    for name, want in (("old", old), ("new", new)):
        if _same(got, want) and client == {"v": name}:
            return name + (" (recovered)" if recovered else "")
    raise AssertionError(f"loaded neither the old nor the new checkpoint (client {client})")


def _tags(reuse: bool) -> tuple[str, str]:
    return ("ckpt", "ckpt") if reuse else ("global_step1", "global_step2")


def _enumerate_body(
    rank: int, world_size: int, *, stage: int, reuse: bool, root: str, skip: tuple = ()
) -> dict:
    """Kill a one-rank save at each file-system call; load after each (in-process)."""
    base = Path(root)
    old_tag, new_tag = _tags(reuse)
    engine = _engine(stage)
    _train(engine, 1, rank)
    engine.save_checkpoint(str(base / "pristine"), tag=old_tag, client_state={"v": "old"})
    old = _fingerprint(engine)
    _train(engine, 1, rank)
    new = _fingerprint(engine)
    shutil.copytree(base / "pristine", base / "count")
    with crash_at(0, skip=skip) as plan:
        engine.save_checkpoint(str(base / "count"), tag=new_tag, client_state={"v": "new"})
    calls = list(plan.calls)
    fresh = _engine(stage, seed=9)
    outcomes: dict[str, int] = {}
    for k in range(1, len(calls) + 1):
        where = base / f"k{k}"
        shutil.copytree(base / "pristine", where)
        try:
            with crash_at(k, skip=skip):
                engine.save_checkpoint(str(where), tag=new_tag, client_state={"v": "new"})
        except Crash:
            pass
        try:
            outcome = _which(fresh, where, old, new)
        except BaseException as exc:
            raise AssertionError(f"killed at call {k} ({calls[k - 1]}): {exc!r}") from exc
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        shutil.rmtree(where)
    return {"calls": len(calls), "outcomes": outcomes}


def test_every_kill_point_of_a_save_loads_the_old_or_the_new_checkpoint(
    tmp_path: Path, stage: int = 2, reuse: bool = True, skip: tuple = ("write", "flush")
) -> None:
    """Default tier: every call but the individual writes of a file's bytes (those only change
    a file in ``.partial``; the slow tier kills at each of them too)."""
    (result,) = run_on_ranks(
        _enumerate_body, 1, stage=stage, reuse=reuse, root=str(tmp_path), skip=skip, timeout=3600
    )
    print(f"one rank, stage {stage}, reuse={reuse}, skip={skip}: {result}")
    assert result["calls"] >= 30  # the save's open/close/fsync/rename... calls were all seen
    assert sum(result["outcomes"].values()) == result["calls"]
    assert "old" in result["outcomes"] and "new" in result["outcomes"]
    if reuse:  # killed between the two renames (a new tag has no old directory to move aside)
        assert "new (recovered)" in result["outcomes"]


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "reuse"), [(2, True), (2, False), (3, True), (3, False)])
def test_every_kill_point_of_a_save_slow(stage: int, reuse: bool, tmp_path: Path) -> None:
    test_every_kill_point_of_a_save_loads_the_old_or_the_new_checkpoint(tmp_path, stage, reuse, ())


# --- two ranks: real kills -------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, job: dict) -> int:
    """A forked rank: save (killed at ``job['kill'][rank]``) or load and report old/new."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    old_tag, new_tag = _tags(job["reuse"])
    if job["what"] == "save":
        engine = _engine(job["stage"])
        _train(engine, 1, rank)
        if job["kill"] is None:
            engine.save_checkpoint(job["dir"], tag=old_tag, client_state={"v": "old"})
            torch.save(_fingerprint(engine), f"{job['dir']}.old.{rank}")
        _train(engine, 1, rank)
        if job["kill"] is None:
            torch.save(_fingerprint(engine), f"{job['dir']}.new.{rank}")
            return 0
        kill = job["kill"][rank]
        with crash_at(kill, hard=True, skip=tuple(job.get("skip", ()))) as plan:
            engine.save_checkpoint(job["dir"], tag=new_tag, client_state={"v": "new"})
        Path(f"{job['dir']}.calls.{rank}").write_text("\n".join(plan.calls))
        return 0
    engine = _engine(job["stage"], seed=9)
    old = torch.load(f"{job['expected']}.old.{rank}", weights_only=True)
    new = torch.load(f"{job['expected']}.new.{rank}", weights_only=True)
    Path(f"{job['dir']}.outcome.{rank}").write_text(_which(engine, Path(job["dir"]), old, new))
    return 0


def _fork_ranks(world: int, job: dict, *, grace: float = 3.0, timeout: float = 600) -> list[int]:
    """Run ``_rank_main`` on ``world`` forked ranks; once one is killed (exit 9) the others get
    ``grace`` seconds (they may be blocked in a collective with it) and are then killed too:
    that is a state a crash of several ranks reaches as well."""
    port, pids = _free_port(), []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _rank_main(rank, world, port, job)
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                os._exit(code)
        pids.append(pid)
    codes: dict[int, int] = {}
    deadline, killed_at = time.monotonic() + timeout, None
    while len(codes) < world:
        for pid in pids:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
                if codes[pid] == 9 and killed_at is None:
                    killed_at = time.monotonic()
        now = time.monotonic()
        if (killed_at is not None and now - killed_at > grace) or now > deadline:
            for pid in pids:
                if pid not in codes:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    codes[pid] = -9
        time.sleep(0.01)
    return [codes[pid] for pid in pids]


def _two_rank_driver(stage: int, reuse: bool, root: str, points: Any, skip: tuple = ()) -> dict:
    """Kill a two-rank save at each (rank, call) of ``points`` (None: every call of both ranks)
    and load after each; returns the call counts and outcome counts."""
    import ds_engine  # noqa: F401  (imported before forking: the ranks start warm)

    warm = torch.nn.Linear(2, 2)  # the optimizer's lazy imports, before forking too
    torch.optim.Adam(warm.parameters()).step()

    base = Path(root)
    job = {"stage": stage, "reuse": reuse, "skip": skip}
    pristine = str(base / "pristine")
    assert _fork_ranks(2, {**job, "what": "save", "dir": pristine, "kill": None}) == [0, 0]
    shutil.copytree(pristine, base / "count")
    count = {**job, "what": "save", "dir": str(base / "count"), "kill": [0, 0]}
    assert _fork_ranks(2, count) == [0, 0]
    calls = [Path(f"{base / 'count'}.calls.{r}").read_text().splitlines() for r in range(2)]
    if points is None:
        points = [(r, k) for r in range(2) for k in range(1, len(calls[r]) + 1)]
    elif points == "rename":  # rank 0's rename of .ckpt.partial onto ckpt
        k = next(
            i
            for i, c in enumerate(calls[0], 1)
            if c.startswith("rename") and c.split()[1].endswith(".ckpt.partial")
        )
        points = [(0, k)]
    outcomes: dict[str, int] = {}
    for rank, k in points:
        where = base / f"r{rank}k{k}"
        shutil.copytree(pristine, where)
        kill = [k if r == rank else 0 for r in range(2)]
        _fork_ranks(2, {**job, "what": "save", "dir": str(where), "kill": kill})
        load = {**job, "what": "load", "dir": str(where), "expected": pristine}
        codes = _fork_ranks(2, load)
        seen = {Path(f"{where}.outcome.{r}").read_text() for r in range(2) if not codes[r]}
        assert codes == [0, 0] and len(seen) == 1, (
            f"rank {rank} killed at call {k} ({calls[rank][k - 1]}): load exit codes {codes}, "
            f"outcomes {seen}"
        )
        outcome = seen.pop()
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        shutil.rmtree(where)
    return {"calls": [len(c) for c in calls], "points": len(points), "outcomes": outcomes}


def _driver_body(
    rank: int, world_size: int, *, stage: int, reuse: bool, root: str, points, skip: tuple
):
    return _two_rank_driver(stage, reuse, root, points, skip)


def _run_driver(
    stage: int, reuse: bool, root: Path, points, timeout: float, skip: tuple = ()
) -> dict:
    (result,) = run_on_ranks(
        _driver_body,
        1,
        stage=stage,
        reuse=reuse,
        root=str(root),
        points=points,
        skip=skip,
        init_process_group=False,
        fresh=True,
        timeout=timeout,
    )
    return result


@pytest.mark.slow
def test_two_ranks_killed_just_before_the_rename_of_a_reused_tag(tmp_path: Path) -> None:
    """The issue's case: rank 0 killed between moving the old ``ckpt`` aside and renaming
    ``.ckpt.partial`` into place; ``latest`` names the missing ``ckpt``."""
    result = _run_driver(2, True, tmp_path, "rename", timeout=300)
    print(result)
    assert result["outcomes"] == {"new (recovered)": 1}


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "reuse"), [(2, True), (2, False), (3, True), (3, False)])
def test_every_kill_point_of_a_two_rank_save(stage: int, reuse: bool, tmp_path: Path) -> None:
    result = _run_driver(stage, reuse, tmp_path, None, timeout=3600)
    print(f"two ranks, stage {stage}, reuse={reuse}: {result}")
    assert result["points"] == sum(result["calls"]) >= 60
    assert {o.split()[0] for o in result["outcomes"]} == {"old", "new"}


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "reuse"), [(2, True), (3, False)])
def test_every_non_write_kill_point_of_a_two_rank_save(
    stage: int, reuse: bool, tmp_path: Path
) -> None:
    """Every call of either rank but the individual writes of a file's bytes."""
    result = _run_driver(stage, reuse, tmp_path, None, timeout=3600, skip=("write", "flush"))
    print(f"two ranks, stage {stage}, reuse={reuse}, writes skipped: {result}")
    assert result["points"] == sum(result["calls"]) >= 40
    assert {o.split()[0] for o in result["outcomes"]} == {"old", "new"}
