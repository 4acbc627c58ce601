"""``deepspeed.checkpoint.ds_to_universal``: a ZeRO checkpoint as DeepSpeed's universal checkpoint,
and the ``ds-to-universal`` command (DeepSpeed's flags)::

    ds-to-universal --input_folder ckpt/global_step100 --output_folder ckpt/global_step100_universal \\
        [--num_extract_workers 4] [--num_merge_workers 2] [--keep_temp_folder] [--no_strict] \\
        [--inject_missing_state]

[Note: universal checkpoint layout]
DeepSpeed's universal checkpoint (``docs/_tutorials/universal-checkpointing.md``) holds every
parameter whole, by name, so any world size and ZeRO stage can load it::

    <output_folder>/mp_rank_00_model_states.pt      the model-states file(s), copied
    <output_folder>/zero/optimizer_state.pt        param-group hyper-parameters, loss scaler
    <output_folder>/zero/<param name>/fp32.pt      {"param": fp32 master, "cat_dim": 0}
    <output_folder>/zero/<param name>/exp_avg.pt   the same for each optimizer moment
    <output_folder>/zero/<param name>/step.pt      the optimizer step
    <parent of output_folder>/latest_universal    the output folder's name

Conversion runs in DeepSpeed's two phases: *extract* (``num_extract_workers`` threads) writes
each piece a saving rank held as a fragment ``tmp/<name>/<state>.<first element>``; *merge*
(``num_merge_workers`` threads) joins each parameter's fragments in element order into its
files. ``tmp/`` is removed unless ``keep_temp_folder``. ``strict`` checks the output (every
parameter's files present, each of its shape) and fails naming what is wrong; without it the
problems are printed. As in DeepSpeed, the model-states file must carry
``universal_checkpoint_info``, which ``inject_missing_state`` adds when absent (engines that
are not Megatron-DeepSpeed never write it). Sources: a ds checkpoint (``zero/manifest.json``;
each saving rank's piece is a fragment) or a DeepSpeed-written one (read whole by
``ds_engine._deepspeed_ckpt``, without running code: one fragment per parameter).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

import ds_zero
from ds_engine._deepspeed_ckpt import (
    DEEPSPEED_VERSION,
    is_deepspeed_checkpoint,
    load_file,
    read_checkpoint,
)
from ds_engine._deepspeed_ckpt._pickle import (
    DynamicLossScalerState,
    LossScalerState,
    ZeroStage,
    save_file,
)
from ds_engine._deepspeed_ckpt._read_moe import EXPERT_PARAM
from ds_engine.checkpoint._convert_layouts import is_moe, read_moe

__all__ = ["UNIVERSAL_CHECKPOINT_INFO", "convert_to_universal", "main", "parse_arguments"]

UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"
_VERSION = {"universal_checkpoint_version": 0.2}
_STATES = {"param": "fp32", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


def parse_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """DeepSpeed's ``ds_to_universal.py`` command line."""
    parser = argparse.ArgumentParser(prog="ds-to-universal", allow_abbrev=False)
    parser.add_argument("--input_folder", required=True, help="the checkpoint's tag folder")
    parser.add_argument("--output_folder", required=True, help="the universal folder to write")
    parser.add_argument("--num_extract_workers", type=int, default=4, help="extract threads")
    parser.add_argument("--num_merge_workers", type=int, default=2, help="merge threads")
    parser.add_argument("--keep_temp_folder", action="store_true", help="keep the tmp/ fragments")
    parser.add_argument("--strict", dest="strict", action="store_true", default=True)
    parser.add_argument(
        "--no_strict", dest="strict", action="store_false", help="report problems, do not fail"
    )
    parser.add_argument(
        "--inject_missing_state",
        action="store_true",
        help=f"add {UNIVERSAL_CHECKPOINT_INFO} to the model states when absent",
    )
    return parser.parse_args(argv)


def _parallel(work: Callable[[Any], None], items: Iterable[Any], workers: int) -> None:
    items = list(items)
    if workers <= 1:
        for item in items:
            work(item)
        return
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for _ in pool.map(work, items):
            pass


def _expert_file(path: Path) -> bool:
    return path.name.startswith("layer_") and "_expert_" in path.name


def _model_files(source: Path) -> list[Path]:
    """The model-states files (MoE expert files apart: they are copied as they are)."""
    files = sorted(p for p in source.glob("*model_states.pt") if not _expert_file(p))
    if not files:
        raise FileNotFoundError(f"{str(source)!r} has no *model_states.pt file: not a tag folder")
    return files


def _shape_of(name: str, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, ...] | None:
    """A parameter's shape; an expert under its global id takes its layer's local expert 0's."""
    if name in shapes:
        return shapes[name]
    match = EXPERT_PARAM.match(name)
    return None if match is None else shapes.get(f"{match['prefix']}0.{match['suffix']}")


def _deepspeed_keys(state: dict[str, Any]) -> None:
    """Make a ds model-states file readable by DeepSpeed's ``load_checkpoint`` too: it needs
    ``mp_world_size`` and finds the client state at the top level (ds nests it under
    ``client_state``, which ds's universal load keeps reading)."""
    state.setdefault("mp_world_size", 1)
    for key, value in dict(state.get("client_state") or {}).items():
        state.setdefault(key, value)


def _check_info(
    files: Sequence[Path], inject: bool, from_ds: bool
) -> list[tuple[Path, dict[str, Any] | None]]:
    """Each model-states file, with its content when it had to change (None: copied as it
    is): ``universal_checkpoint_info`` injected, and, from a ds checkpoint (``from_ds``),
    DeepSpeed's engine keys added (see :func:`_deepspeed_keys`)."""
    out: list[tuple[Path, dict[str, Any] | None]] = []
    for file in files:
        state = dict(load_file(file))  # never runs code; DeepSpeed's types allowed
        if from_ds:
            _deepspeed_keys(state)
        if UNIVERSAL_CHECKPOINT_INFO in state:
            out.append((file, state if from_ds else None))
            continue
        if UNIVERSAL_CHECKPOINT_INFO not in state:
            if not inject:
                raise ValueError(
                    f"{str(file)!r} has no {UNIVERSAL_CHECKPOINT_INFO!r} (only Megatron-DeepSpeed "
                    "clients write it); pass --inject_missing_state (inject_missing_state=True) "
                    "to add it, as with DeepSpeed's ds_to_universal"
                )
            state[UNIVERSAL_CHECKPOINT_INFO] = dict(_VERSION)
        out.append((file, state))
    return out


class _DeepSpeedSource:
    """A DeepSpeed tag folder, read whole, seen as a :class:`ds_zero.CheckpointView`."""

    def __init__(self, path: Path) -> None:
        self.state = read_checkpoint(path, _moe_trainable(path))
        if not self.state.fp32:
            raise ValueError(
                f"{str(path)!r} holds no ZeRO optimizer files (stage 0): a universal checkpoint "
                "needs ZeRO stage 1-3, as in DeepSpeed"
            )
        self.stage = self.state.stage
        shapes: dict[str, tuple[int, ...]] = {}
        for group in self.state.engine.get("param_shapes") or []:
            shapes.update({n: tuple(int(d) for d in s) for n, s in group.items()})
        self.shapes = {n: _shape_of(n, shapes) or (v.numel(),) for n, v in self.state.fp32.items()}

    def pieces(self, name: str) -> list[tuple[int, int]]:
        return [(0, self.state.fp32[name].numel())]

    def values(self, name: str, start: int, stop: int) -> dict[str, torch.Tensor]:
        out = {"param": self.state.fp32[name][start:stop]}
        out.update({k: v[start:stop] for k, v in self.state.moments.get(name, {}).items()})
        return out

    def scalars(self) -> dict[str, Any]:
        groups = [
            {"hyper": g["hyper"], "state": {} if g["step"] is None else {"step": g["step"]}}
            for g in self.state.groups
        ]
        return {"param_groups": groups, "loss_scaler": self.state.loss_scaler}

    def close(self) -> None:
        pass


def _moe_trainable(path: Path) -> list[str]:
    """The trainable names a DeepSpeed MoE checkpoint's ZeRO files hold (its ``param_shapes``:
    rank 0's local expert names); empty without MoE (the reader needs no model then)."""
    model = path / "mp_rank_00_model_states.pt"
    if not any(_expert_file(p) for p in path.iterdir()) or not model.is_file():
        return []
    shapes = load_file(model).get("param_shapes") or []
    return [n for group in shapes for n in group]


class _MoESource:
    """A ds MoE checkpoint (ZeRO 0-2, per-rank ZeRO files), read whole, experts by global id
    (see ``_convert_layouts``), seen as a :class:`ds_zero.CheckpointView`."""

    def __init__(self, path: Path) -> None:
        state, _, first = read_moe(path, lambda saved: (saved, None))
        self.stage = int(first.get("stage") or 0)
        self.whole = state.whole
        local = {n: tuple(int(d) for d in v) for n, v in state.shapes.items()}
        self.shapes = {
            n: _shape_of(n, local) or (v["param"].numel(),) for n, v in self.whole.items()
        }
        groups = []
        for t in state.templates:
            groups.append({"hyper": t.hyper, "state": {} if t.step is None else {"step": t.step}})
        self._scalars = {
            "param_groups": groups,
            "loss_scaler": first.get("loss_scaler"),
            "counters": first.get("counters", {}),
        }

    def pieces(self, name: str) -> list[tuple[int, int]]:
        return [(0, self.whole[name]["param"].numel())]

    def values(self, name: str, start: int, stop: int) -> dict[str, torch.Tensor]:
        return {k: v[start:stop] for k, v in self.whole[name].items()}

    def scalars(self) -> dict[str, Any]:
        return self._scalars

    def close(self) -> None:
        pass


def _extract(view: Any, temp: Path, workers: int) -> None:
    """Phase 1: one fragment file per saved piece and state."""

    def work(item: tuple[str, int, int]) -> None:
        name, start, stop = item
        folder = temp / name
        folder.mkdir(parents=True, exist_ok=True)
        for value, tensor in view.values(name, start, stop).items():
            torch.save(tensor.clone(), folder / f"{_STATES.get(value, value)}.{start:012d}")

    _parallel(work, [(n, a, b) for n in view.shapes for a, b in view.pieces(n)], workers)


def _merge(
    shapes: dict[str, tuple[int, ...]], temp: Path, zero: Path, step: Any, workers: int
) -> None:
    """Phase 2: each parameter's fragments joined, in element order, into its state files."""

    def work(name: str) -> None:
        folder, out = temp / name, zero / name
        out.mkdir(parents=True, exist_ok=True)
        states = sorted({p.name.rsplit(".", 1)[0] for p in folder.iterdir()})
        for state in states:
            parts = sorted(folder.glob(f"{state}.*"), key=lambda p: int(p.suffix[1:]))
            flat = torch.cat([torch.load(p, weights_only=True) for p in parts])
            torch.save({"param": flat.view(shapes[name]), "cat_dim": 0}, out / f"{state}.pt")
        if step is not None:  # a float tensor, as torch's optimizers (and DeepSpeed) keep it
            value = step.item() if torch.is_tensor(step) else step
            torch.save(torch.tensor(float(value)), out / "step.pt")

    _parallel(work, list(shapes), workers)


def _problems(shapes: dict[str, tuple[int, ...]], zero: Path) -> list[str]:
    problems = []
    for name, shape in shapes.items():
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            path = zero / name / f"{state}.pt"
            if not path.is_file():
                problems.append(f"{path} was not written")
                continue
            got = tuple(torch.load(path, weights_only=True)["param"].shape)
            if got != shape:
                problems.append(f"{path} has shape {got}, the parameter's is {shape}")
    return problems


def _loss_scaler(saved: Any) -> LossScalerState:
    """DeepSpeed's loss-scaler object for a saved scaler: None (fp32, bf16), ds's scaler state
    dict (``cur_iter`` when dynamic) or a DeepSpeed scaler's attributes (``dynamic``)."""
    saved = vars(saved) if hasattr(saved, "__dict__") else saved
    if not isinstance(saved, Mapping):
        return LossScalerState(cur_scale=1.0, dynamic=False)
    if "dynamic" in saved:  # a DeepSpeed scaler's own attributes
        kind = DynamicLossScalerState if saved["dynamic"] else LossScalerState
        return kind(**saved)
    if "cur_iter" not in saved:
        return LossScalerState(cur_scale=float(saved["cur_scale"]), dynamic=False)
    return DynamicLossScalerState(
        cur_scale=float(saved["cur_scale"]),
        dynamic=True,
        cur_iter=int(saved["cur_iter"]),
        last_overflow_iter=int(saved.get("last_overflow_iter", -1)),
        cur_hysteresis=int(saved.get("cur_hysteresis", 2)),
        scale_factor=float(saved.get("scale_factor", 2.0)),
        scale_window=int(saved.get("scale_window", 1000)),
        min_scale=saved.get("min_scale", 1),
        delayed_shift=int(saved.get("delayed_shift", 2)),
        consecutive_hysteresis=bool(saved.get("consecutive_hysteresis", False)),
        raise_error_at_min_scale=bool(saved.get("raise_error_at_min_scale", True)),
        dtype=torch.float16,
    )


def _optimizer_state(scalars: dict[str, Any], stage: Any) -> tuple[dict[str, Any], Any]:
    """``zero/optimizer_state.pt``: DeepSpeed's global optimizer state (the keys its
    ``_load_global_state`` reads: the loss scaler object, ``dynamic_loss_scale``, ``overflow``,
    ``zero_stage``, ``ds_version``, ``param_groups``), plus ds's ``counters``; and the step."""
    groups = []
    step = None
    for g in scalars["param_groups"]:
        groups.append({**g["hyper"], "params": []})
        if step is None and "step" in g["state"]:
            step = g["state"]["step"]
    scaler = _loss_scaler(scalars.get("loss_scaler"))
    state = {
        "param_groups": groups,
        "loss_scaler": scaler,
        "dynamic_loss_scale": bool(getattr(scaler, "dynamic", False)),
        "overflow": False,
        "zero_stage": ZeroStage(int(stage)),
        "ds_version": DEEPSPEED_VERSION,
        "counters": scalars.get("counters", {}),
    }
    return state, step


def convert_to_universal(
    input_folder: str | Path,
    output_folder: str | Path,
    *,
    num_extract_workers: int = 4,
    num_merge_workers: int = 2,
    keep_temp_folder: bool = False,
    strict: bool = True,
    inject_missing_state: bool = False,
) -> Path:
    """Write the ZeRO checkpoint tag folder ``input_folder`` as a universal checkpoint (see
    [Note: universal checkpoint layout]); returns the output folder.

    Example:
        >>> convert_to_universal("ckpt/global_step9", "ckpt/global_step9_universal",
        ...                      inject_missing_state=True)
    """
    for flag, value in (
        ("num_extract_workers", num_extract_workers),
        ("num_merge_workers", num_merge_workers),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag} = {value!r}: expected a whole number >= 1")
    source, out = Path(input_folder), Path(output_folder)
    from_deepspeed = is_deepspeed_checkpoint(source)
    models = _check_info(_model_files(source), inject_missing_state, not from_deepspeed)
    if from_deepspeed:
        view: Any = _DeepSpeedSource(source)
    elif is_moe(source) and (source / "zero" / "metadata.json").is_file():
        view = _MoESource(source)  # ds's MoE experts: per-rank ZeRO files
    else:
        view = ds_zero.CheckpointView(source)
    zero, temp = out / "zero", out / "tmp"
    shutil.rmtree(out, ignore_errors=True)
    zero.mkdir(parents=True)
    try:
        optimizer_state, step = _optimizer_state(view.scalars(), view.stage)
        print("*** 1. Extracting ZeRO fragments", file=sys.stderr)
        _extract(view, temp, num_extract_workers)
        print("*** 2. Merging slices", file=sys.stderr)
        _merge(view.shapes, temp, zero, step, num_merge_workers)
    finally:
        view.close()
    print("*** 3. Saving common optimizer states", file=sys.stderr)
    save_file(optimizer_state, zero / "optimizer_state.pt")  # DeepSpeed's class names
    if not keep_temp_folder:
        shutil.rmtree(temp, ignore_errors=True)
    for file in sorted(p for p in source.glob("*model_states.pt") if _expert_file(p)):
        shutil.copy2(file, out / file.name)  # MoE experts: weights by global id, as saved
    for file, state in models:
        if state is None:
            shutil.copy2(file, out / file.name)
        else:
            save_file(state, out / file.name)  # DeepSpeed's own types keep their names
    problems = _problems(view.shapes, zero)
    if problems and strict:
        raise ValueError(
            f"universal checkpoint {str(out)!r} is incomplete:\n  " + "\n  ".join(problems)
        )
    for problem in problems:
        print(f"warning: {problem}", file=sys.stderr)
    (out.parent / "latest_universal").write_text(out.name)
    return out


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """``ds-to-universal``: convert, with DeepSpeed's flags."""
    if not isinstance(args, argparse.Namespace):
        args = parse_arguments(args)
    convert_to_universal(
        args.input_folder,
        args.output_folder,
        num_extract_workers=args.num_extract_workers,
        num_merge_workers=args.num_merge_workers,
        keep_temp_folder=args.keep_temp_folder,
        strict=args.strict,
        inject_missing_state=args.inject_missing_state,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
