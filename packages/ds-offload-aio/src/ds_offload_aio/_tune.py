"""``ds-nvme-tune``: sweep ``AioHandle`` settings on a directory, print the best ``aio`` section.

Every combination of block_size x queue_depth x intra_op_parallelism x single_submit x
overlap_events writes then reads ``--io_size`` bytes (O_DIRECT, from a page-locked buffer, or
a CUDA tensor with ``--gpu``) to one file in ``--nvme_dir``; the median of ``--loops`` runs is
reported in GB/s (10^9 bytes/s). The best configuration maximises the rate of a write plus a
read of the same bytes (the harmonic mean of the two rates; one rate when the other is skipped).
overlap_events=False wins only when it is clearly faster: it drains the whole queue before
resubmitting, which a short sweep (each thread's share within one queue) cannot show.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ds_offload_aio._handle import AioHandle
from ds_offload_aio._pinned import allocate_locked
from ds_offload_aio.api import AioConfig, ConfigError

DEFAULT_SWEEP: dict[str, list[Any]] = {
    "block_size": ["128K", "256K", "1M"],
    "queue_depth": [8, 32, 128],
    "intra_op_parallelism": [1, 2, 4, 8],
    "single_submit": [False, True],
    "overlap_events": [True, False],
}
# DeepSpeed's sweep files call intra_op_parallelism io_parallel (older: thread_count).
_ALIASES = {"io_parallel": "intra_op_parallelism", "thread_count": "intra_op_parallelism"}
# How much faster overlap_events=False must measure to be picked (see ``rank``).
_OVERLAP_EDGE = 0.05
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str | int) -> int:
    """``"128K"`` -> 131072, ``"1G"`` -> 1073741824, ``4096`` -> 4096 (binary units)."""
    if isinstance(text, int):
        return text
    value = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        if value and value[-1] in _UNITS:
            return int(float(value[:-1]) * _UNITS[value[-1]])
        return int(value)
    except ValueError:
        raise ValueError(f"{text!r} is not a size such as 4096, 128K, 1M or 2G") from None


@dataclass(frozen=True)
class TuneResult:
    """One configuration's median read and write rates in GB/s (None when not measured)."""

    config: AioConfig
    read_gbps: float | None
    write_gbps: float | None

    @property
    def score(self) -> float:
        rates = [r for r in (self.read_gbps, self.write_gbps) if r is not None]
        return len(rates) / sum(1 / max(r, 1e-12) for r in rates)


def rank(results: Sequence[TuneResult]) -> list[TuneResult]:
    """The results, best first; overlap_events=True beats a score up to ``_OVERLAP_EDGE`` higher.

    Without overlap_events the handle drains its queue before resubmitting, which costs nothing
    while each thread's share fits one queue (a short sweep) but much at large transfers; so a
    near-tie in the sweep is no evidence for batch-by-batch submission.
    """
    edge = 1 + _OVERLAP_EDGE
    return sorted(
        results, key=lambda r: r.score * (edge if r.config.overlap_events else 1), reverse=True
    )


def sweep_configs(sweep: Mapping[str, Sequence[Any]]) -> list[AioConfig]:
    """Every combination of the sweep's values (missing keys take ``DEFAULT_SWEEP``'s)."""
    spec = dict(DEFAULT_SWEEP)
    for key, values in sweep.items():
        name = _ALIASES.get(key, key)
        if name not in DEFAULT_SWEEP:
            raise ConfigError(f"sweep key {key!r} is not one of {sorted(DEFAULT_SWEEP)}")
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
            raise ConfigError(f"sweep key {key!r} = {values!r}: expected a non-empty list")
        spec[name] = list(values)
    spec["block_size"] = [parse_size(v) for v in spec["block_size"]]
    names = list(spec)
    return [AioConfig(**dict(zip(names, combo))) for combo in itertools.product(*spec.values())]


def _rate(nbytes: int, run: Any) -> float:
    start = time.perf_counter()
    run()
    return nbytes / (time.perf_counter() - start) / 1e9


def measure(
    config: AioConfig, buffer: torch.Tensor, path: str, *, loops: int, read: bool, write: bool
) -> TuneResult:
    """Median write and read rates of one configuration (write first, so reads see real data)."""
    nbytes = buffer.numel() * buffer.element_size()
    reads, writes = [], []
    with AioHandle.from_config(config) as handle:
        for _ in range(loops):
            if write:
                writes.append(_rate(nbytes, lambda: handle.sync_pwrite(buffer, path)))
            if read:
                reads.append(_rate(nbytes, lambda: handle.sync_pread(buffer, path)))
    return TuneResult(
        config,
        statistics.median(reads) if reads else None,
        statistics.median(writes) if writes else None,
    )


def tune(
    nvme_dir: str | os.PathLike[str],
    io_size: int,
    sweep: Mapping[str, Sequence[Any]] | None = None,
    *,
    loops: int = 1,
    read: bool = True,
    write: bool = True,
    device: str = "cpu",
    progress: bool = True,
) -> list[TuneResult]:
    """Measures every configuration of the sweep; returns the results, best first.

    Example:
        >>> best = tune("/nvme", 1 << 30, {"intra_op_parallelism": [1, 4]})[0]
        >>> best.config.handle_kwargs()
    """
    if not (read or write):
        raise ValueError("nothing to measure: read and write are both off")
    configs = sweep_configs(sweep or {})
    path = os.path.join(os.fspath(nvme_dir), f".ds_nvme_tune.{os.getpid()}.bin")
    if device == "cpu":
        buffer = allocate_locked(io_size)
    else:
        buffer = torch.empty(io_size, dtype=torch.uint8, device=device)
    buffer.fill_(0x5A)
    results = []
    try:
        if not write:  # the reads need a file of io_size real bytes
            with AioHandle(backend="auto") as handle:
                handle.sync_pwrite(buffer, path)
        for config in tqdm(configs, desc="ds-nvme-tune", unit="cfg", disable=not progress):
            results.append(measure(config, buffer, path, loops=loops, read=read, write=write))
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return rank(results)


def format_table(results: Sequence[TuneResult]) -> str:
    """The sweep as a fixed-width table, best first."""

    def rate(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    header = (
        f"{'block_size':>10} {'queue_depth':>11} {'intra_op_par':>12} {'single_submit':>13} "
        f"{'overlap_events':>14} {'read GB/s':>9} {'write GB/s':>10}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        c = r.config
        lines.append(
            f"{c.block_size:>10} {c.queue_depth:>11} {c.intra_op_parallelism:>12} "
            f"{c.single_submit!s:>13} {c.overlap_events!s:>14} {rate(r.read_gbps):>9} "
            f"{rate(r.write_gbps):>10}"
        )
    return "\n".join(lines)


def aio_section(config: AioConfig) -> dict[str, Any]:
    """The JSON ``aio`` config section for a configuration."""
    return {"aio": config.handle_kwargs()}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ds-nvme-tune",
        description="Find the AioHandle settings that move data fastest on a directory's disk.",
    )
    parser.add_argument("--nvme_dir", required=True, help="directory on the disk to tune")
    parser.add_argument("--io_size", default="400M", help="bytes per read/write (default 400M)")
    parser.add_argument(
        "--sweep_config",
        help="JSON file (or inline JSON object) of lists per key, e.g. "
        '\'{"block_size": ["256K", "1M"], "intra_op_parallelism": [2, 4]}\'',
    )
    parser.add_argument("--no_read", action="store_true", help="skip the read measurements")
    parser.add_argument("--no_write", action="store_true", help="skip the write measurements")
    parser.add_argument("--loops", type=int, default=1, help="runs per configuration (median)")
    parser.add_argument("--gpu", action="store_true", help="move a CUDA tensor (bounce buffers)")
    return parser


def _load_sweep(text: str | None) -> dict[str, Any]:
    if text is None:
        return {}
    source = text if text.lstrip().startswith("{") else Path(text).read_text()
    sweep = json.loads(source)
    if not isinstance(sweep, dict):
        raise ConfigError(f"--sweep_config must hold a JSON object, got {type(sweep).__name__}")
    return sweep


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``ds-nvme-tune``."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.no_read and args.no_write:
        parser.error("--no_read and --no_write leave nothing to measure")
    if not os.path.isdir(args.nvme_dir):
        parser.error(f"--nvme_dir {args.nvme_dir}: not a directory")
    if args.gpu and not torch.cuda.is_available():
        parser.error("--gpu needs a CUDA device, and torch sees none")
    if args.loops < 1:
        parser.error(f"--loops {args.loops}: expected at least 1")
    try:
        io_size = parse_size(args.io_size)
        sweep = _load_sweep(args.sweep_config)
        sweep_configs(sweep)  # report a bad sweep before allocating anything
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    results = tune(
        args.nvme_dir,
        io_size,
        sweep,
        loops=args.loops,
        read=not args.no_read,
        write=not args.no_write,
        device="cuda" if args.gpu else "cpu",
    )
    print(format_table(results))
    print(f"\nBest of {len(results)} configurations ({io_size} bytes, {args.nvme_dir}):")
    print(json.dumps(aio_section(results[0].config), indent=2))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
