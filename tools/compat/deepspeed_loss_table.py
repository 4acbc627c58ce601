"""Print the loss tables of DeepSpeed's checkpoints crossing into ds and back.

Run it with ds's dev environment (real DeepSpeed at ``/tmp/dsref`` for ``--round-trips`` and
``--universal``)::

    OMP_NUM_THREADS=1 .venv/bin/python tools/compat/deepspeed_loss_table.py [--round-trips] \
        [--write] [--universal] [--skip-resume]

1. DeepSpeed -> ds: every checkpoint real DeepSpeed 0.19.8 wrote
   (``packages/ds-engine/tests/fixtures/deepspeed_0.19.8``, ZeRO stage 0-3 x fp32/bf16/fp16 x
   1 and 2 ranks, the pipeline, MoE at stages 0 and 2) resumes in ds on 1 and on 2 ranks; ds's
   next 3 losses against the 3 DeepSpeed computed resuming the same checkpoint
   (``resumed_losses`` in ``expected.json``). Every loss is the mean over the whole global
   batch, so the trajectory does not depend on the number of ranks (MoE on 1 rank excepted: the
   gate's token capacity depends on the tokens per rank, so that row is not comparable).
2. ``--round-trips``: DeepSpeed (W ranks) -> ds (3 - W ranks, one step, then
   ``save_deepspeed_checkpoint``) -> DeepSpeed (W ranks, two steps), ZeRO stages 1-3; the three
   losses after the checkpoint against DeepSpeed's own resume.
3. ``--write``: ds (W ranks, stage S) -> ``save_deepspeed_checkpoint`` for DeepSpeed (W', S')
   -> DeepSpeed (two steps): every case of ``tests/test_deepspeed_write.py`` (stages 0-3,
   param groups, bf16/fp16, pipelines of one and two stages, MoE at stages 0-2 with one or
   several ``ep_size``), ds's next two losses against DeepSpeed's.
4. ``--universal``: ds (W ranks, stage S) -> ``ds-to-universal`` -> DeepSpeed with
   ``checkpoint.load_universal`` (other W, S); DeepSpeed's 3 losses against the uninterrupted ds
   run's.

Tolerances (the tests' [Note: DeepSpeed resume tolerance]): fp32 1e-6, bf16 1e-3, fp16 5e-3
(2e-2 at stage 0), universal relative 1e-5.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "packages" / "ds-engine" / "tests"
TOLERANCE = {"fp32": 1e-6, "bf16": 1e-3, "fp16": 5e-3}


def _module(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _fx() -> Any:
    sys.path.insert(0, str(TESTS))
    import _deepspeed_fixtures

    return _deepspeed_fixtures


def _tolerance(dtype: str, stage: int) -> float:
    return 2e-2 if (dtype, stage) == ("fp16", 0) else TOLERANCE[dtype]


def resume_all(rank: int, world: int) -> dict[str, list[float]]:
    """ds resumes every fixture on ``world`` ranks (one process group, a fresh engine each)."""
    import ds_comm

    fx = _fx()
    out: dict[str, list[float]] = {}
    for name, case in sorted(fx.expected()["cases"].items()):
        if "error" in case:
            continue
        cfg = fx.config_for(case, world)
        if case["kind"] == "pipe":
            engine = fx.build_pipe_engine(cfg)
            engine.load_checkpoint(str(fx.FIXTURES / name))
            out[name] = fx.train_pipe(engine, 3, 3, rank, world)
        else:
            if case["kind"] == "moe":
                engine = fx.build_moe_engine(cfg, world)
            else:
                engine = fx.build_engine(cfg)
            engine.load_checkpoint(str(fx.FIXTURES / name))
            out[name] = fx.train(engine, 3, 3, rank, world, case["dtype"])
        ds_comm.barrier()
    return out


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _losses(values: list[float]) -> str:
    return ", ".join(f"{v:.7f}" for v in values)


def table_deepspeed_to_ds() -> bool:
    from ds_testing import run_on_ranks

    fx = _fx()
    cases = fx.expected()["cases"]
    results = {w: run_on_ranks(resume_all, w, timeout=1800)[0] for w in (1, 2)}
    print("\n### DeepSpeed 0.19.8 checkpoint -> ds resume (next 3 losses)\n")
    head = ["case", "stage", "dtype", "ranks", "DeepSpeed resumed", "ds resumed", "max abs diff"]
    print(_row(head))
    print(_row(["---"] * len(head)))
    ok = True
    for name, case in sorted(cases.items()):
        if "error" in case:
            continue
        for world in (1, 2):
            got, want = results[world][name], case["resumed_losses"]
            diff = max(abs(a - b) for a, b in zip(got, want))
            comparable = not (case["kind"] == "moe" and world != case["world_size"])
            tol = _tolerance(case["dtype"], case["stage"])
            verdict = f"{diff:.1e}" if comparable else f"{diff:.1e} (not comparable: MoE gate)"
            if comparable and diff > tol:
                verdict += f" > {tol:g} FAIL"
                ok = False
            cells = [name, str(case["stage"]), case["dtype"], f"{case['world_size']} -> {world}"]
            print(_row([*cells, _losses(want), _losses(got), verdict]))
    return ok


def table_round_trips() -> bool:
    from ds_testing import run_on_ranks

    fx = _fx()
    test = _module("test_deepspeed_checkpoints", TESTS / "test_deepspeed_checkpoints.py")
    print("\n### DeepSpeed -> ds -> DeepSpeed (ds: one step, then DeepSpeed: two steps)\n")
    head = [
        "case",
        "DeepSpeed -> ds -> DeepSpeed ranks",
        "DeepSpeed resumed",
        "round trip",
        "max abs diff",
    ]
    print(_row(head))
    print(_row(["---"] * len(head)))
    ok = True
    for name, ds_world in test._ROUND_TRIPS:
        case = fx.expected()["cases"][name]
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "for_deepspeed"
            ds_losses = run_on_ranks(
                test._ds_leg_body, ds_world, name, str(out), case["world_size"], timeout=600
            )[0]
            result = test._deepspeed_resume(out, case["world_size"], case["stage"], case["dtype"])
        got, want = ds_losses + result["losses"], case["resumed_losses"]
        diff = max(abs(a - b) for a, b in zip(got, want))
        tol = _tolerance(case["dtype"], case["stage"])
        verdict = f"{diff:.1e}" + ("" if diff <= tol else f" > {tol:g} FAIL")
        ok = ok and diff <= tol
        ranks = f"{case['world_size']} -> {ds_world} -> {case['world_size']}"
        print(_row([name, ranks, _losses(want), _losses(got), verdict]))
    return ok


def table_write(only: str | None = None) -> bool:
    test = _module("test_deepspeed_write", TESTS / "test_deepspeed_write.py")
    print("\n### ds -> save_deepspeed_checkpoint -> DeepSpeed (next 2 losses)\n")
    head = ["model", "dtype", "ds (ranks, stage)", "DeepSpeed (ranks, stage)"]
    head += ["ds continued", "DeepSpeed resumed", "max abs diff"]
    print(_row(head))
    print(_row(["---"] * len(head)))
    cases = [("net", "fp32", (w, s), (3 - w, s)) for s, w in test._RESUME] + test._VARIANTS
    if only:
        cases = [c for c in cases if any(c[0].startswith(m) for m in only.split(","))]
    ok = True
    for model, dtype, ds, deepspeed in cases:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                got = test.check_deepspeed_resumes(
                    Path(tmp), model, dtype, ds=ds, deepspeed=deepspeed
                )
                verdict = f"{got['diff']:.1e}"
                cells = [_losses(got["ds"]), _losses(got["deepspeed"]), verdict]
            except AssertionError as exc:
                ok = False
                cells = ["", "", f"FAIL {str(exc)[:200]}"]
        print(_row([model, dtype, str(ds), str(deepspeed), *cells]))
    return ok


def table_universal() -> bool:
    test = _module("test_universal", TESTS / "test_universal.py")
    print("\n### ds -> ds-to-universal -> DeepSpeed `load_universal` (next 3 losses)\n")
    head = [
        "ds (ranks, stage)",
        "DeepSpeed (ranks, stage)",
        "ds continued",
        "DeepSpeed resumed",
        "max rel diff",
    ]
    print(_row(head))
    print(_row(["---"] * len(head)))
    ok = True
    for saved, loaded in test._TO_DEEPSPEED:
        with tempfile.TemporaryDirectory() as tmp:
            save_dir, continued = test.make_ds_universal(Path(tmp), *saved)
            result = test.deepspeed_resumes_universal(save_dir, *loaded)
        got = result["resumed"]
        diff = max(abs(a - b) / abs(b) for a, b in zip(got, continued))
        verdict = f"{diff:.1e}" + ("" if diff <= test.RTOL else f" > {test.RTOL:g} FAIL")
        ok = ok and diff <= test.RTOL
        print(_row([str(saved), str(loaded), _losses(continued), _losses(got), verdict]))
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--round-trips", action="store_true", help="DeepSpeed -> ds -> DeepSpeed")
    parser.add_argument(
        "--write", action="store_true", help="ds -> DeepSpeed's layout -> DeepSpeed"
    )
    parser.add_argument("--only", default=None, help="--write: models starting so (a,b,...)")
    parser.add_argument("--universal", action="store_true", help="ds -> universal -> DeepSpeed")
    parser.add_argument("--skip-resume", action="store_true", help="no DeepSpeed -> ds table")
    args = parser.parse_args()
    ok = True
    if not args.skip_resume:
        ok = table_deepspeed_to_ds() and ok
    if args.round_trips:
        ok = table_round_trips() and ok
    if args.write:
        ok = table_write(args.only) and ok
    if args.universal:
        ok = table_universal() and ok
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
