"""Optimizer step speed: CPUAdam against torch's Adams and the memory bound, in one run.

It runs one case per layout and thread count (default: each of the two layouts at 1 thread and
at torch's thread count): a "model" of ``--params`` fp32 parameters as a flat list of a few
tensors (as ZeRO keeps its partitions), and one tensor of ``--single-params`` (one large
partition: nothing else overlaps its step, so the kernel's single pass must itself keep up with
memory). With a fixed random gradient, each case times:

* the memory bound: the best GB/s of STREAM's triad ``a = b + s * c`` over arrays of the model's
  size (counted as STREAM counts it, 24 bytes/element), by ds_native's C kernel and by torch
  (``torch.add(b, c, alpha=s, out=a)``), and of ds_native's ``stream_adam_traffic``: CPUAdam's
  own loops with the Adam arithmetic replaced by ``x += s * grad`` (for x in param, exp_avg,
  exp_avg_sq), i.e. Adam's loads and stores alone (28 bytes/param). The C kernels run on
  CPUAdam's threads and thread pool. See [Note: which bound] below.
* ``ds_optim.CPUAdam.step()``, and ``torch.optim.Adam`` as constructed by default (the for-loop
  implementation on CPU), with ``foreach=True`` and with ``fused=True``;
* ZeRO-Offload's step: CPUAdam writing the new params into a bf16 copy in the same pass
  (``step(fp16_param_groups=...)``) against torch's fused Adam followed by ``copy_`` to bf16.

Adam moves 28 bytes per parameter (reads param, grad, exp_avg, exp_avg_sq; writes param,
exp_avg, exp_avg_sq), 30 with the bf16 copy; GB/s is bytes x params / time. After two warm-up
rounds, each of ``--repeats`` rounds times every contender once, with compared pairs next to
each other (alternating the order between rounds), so that drift and the neighbours' load hit
all alike; before each timed call a read of twice the last-level cache leaves it cold and clean
(see ``CacheWipe``). Tables show medians over the rounds; each target is the median over
rounds of that round's ratio. On a shared machine one round's ratio moves by tens of percent
(the memory bandwidth a VM gets changes from one step to the next: 0.75x-1.5x in a round was
seen on the 2-core CI VM), so the default is 15 rounds: with 7, the median itself moved by
about 0.1 between runs of the same code. Targets (issue 19's): CPUAdam >= 80% of the bound
(its ns/param within 25% of the floor, 28 B / the bound's GB/s), >= 1.1x torch's fused Adam,
>= 3x torch's default Adam;
with the bf16 copy-out, >= 1.3x torch fused + copy. A summary table ends the run, one row per
case. With CUDA,
``ds_optim.FusedAdam`` is also timed against ``torch.optim.AdamW(fused=True)`` on the GPU.

[Note: which bound]
Each candidate is something an Adam step could at best match: the triad with ordinary stores
(the STREAM convention; its stores read each line before overwriting it, so 32 bytes move for
the 24 counted, while all 28 of Adam's are real), and Adam's own traffic (CPUAdam minus its
arithmetic: the ceiling by construction). Which is faster depends on the machine, so each
round's bound is the best of them. The table also shows the triad with streaming (non-temporal)
stores, whose 24 counted bytes are the bytes moved: the raw read+write bandwidth ("% of raw").
It is not the bound: Adam's in-place updates cannot use streaming stores, and its 4-read/3-write
mix turns the memory bus around more often than the triad's 2:1 (on the machines measured,
Adam's traffic alone reached 60-90% of it).

Keep ``--params`` well above the last-level cache (50M params are 800 MB of state): a model that
fits in cache measures the cache, not memory.

Usage (from the workspace root)::

    uv run python tools/bench/optim.py               # 50M in 5 tensors, 20M in one; 1 and all threads
    uv run python tools/bench/optim.py --params 10000000 --repeats 3 --threads 2 --layouts split
    DS_NATIVE_ADAM_SIMD=avx2 uv run python tools/bench/optim.py   # pin CPUAdam's code path
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import ds_native
import ds_optim

ADAM_BYTES = 28  # per fp32 param
COPY_BYTES = ADAM_BYTES + 2  # and a bf16 copy written
TRIAD_BYTES = 24  # per element, as STREAM counts it
WARMUP = 2
# CPUAdam's share of the memory bound: ns/param within 25% of the floor (1 / 1.25).
SHARE_TARGET = 0.80
# Idle time before each timed call, so that no contender starts while the previous one's threads
# are still spinning down (libgomp spins a while after each torch parallel region).
PAUSE_S = 0.02

# Row names the targets refer to.
TRAFFIC = "Adam's traffic, ds_native C"
RAW = "triad, streaming stores (raw bandwidth)"
OURS = "ds_optim.CPUAdam"
OURS_COPY = "CPUAdam + fused bf16 copy-out"
TORCH_FUSED = "torch Adam (fused=True)"
TORCH_DEFAULT = "torch Adam (default)"
TORCH_COPY = "torch fused Adam, then copy_ to bf16"


@dataclass(frozen=True)
class Contender:
    """A timed callable; ``nbytes`` is what one call moves (for GB/s); ``table`` where it shows."""

    name: str
    run: Callable[[], object]
    nbytes: int
    table: str


Samples = dict[str, list[float]]
"""Seconds per call of each contender, one entry per round."""

TABLES = {
    "bound": "memory bound (Adam's traffic: 28 B/param; triads: 24 B/element)",
    "adam": "Adam step (28 B/param)",
    "offload": "ZeRO-Offload step: Adam + bf16 copy of the params (30 B/param)",
    "gpu": "GPU Adam step (28 B/param)",
}


def split_sizes(total: int, parts: int = 5) -> list[int]:
    """``total`` elements as ``parts`` tensors of unequal sizes (40%, 25%, 15%, 12%, rest)."""
    shares = [0.40, 0.25, 0.15, 0.12][: parts - 1]  # parts=1: one tensor
    sizes = [max(1, int(total * s)) for s in shares]
    return [*sizes, total - sum(sizes)]


def make_params(sizes: list[int], device: str = "cpu") -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = []
    for n in sizes:
        p = torch.nn.Parameter(torch.randn(n, generator=gen).to(device))
        p.grad = torch.randn(n, generator=gen).to(device)
        params.append(p)
    return params


def last_level_cache_bytes() -> int:
    """The last-level cache's size from sysfs (Linux), else 64 MiB."""
    caches = sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"))
    if not caches:
        return 64 << 20
    text = caches[-1].read_text().strip()
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


class CacheWipe:
    """Reads twice the last-level cache, so that the next call starts from a cold, clean cache.

    Without it a kernel would pay for writing back the lines the previous contender left dirty
    (a 300 MB cache holds a sizeable part of a 50M-param step), and which contender ran before
    would move the timings.
    """

    def __init__(self) -> None:
        self.buffer = torch.ones(2 * last_level_cache_bytes() // 4)

    def __call__(self) -> None:
        self.buffer.sum()
        time.sleep(PAUSE_S)


def time_rounds(contenders: list[Contender], repeats: int) -> Samples:
    """Every contender once per round, in list order, reversed every other round."""
    for _ in range(WARMUP):
        for c in contenders:
            c.run()
    wipe = CacheWipe()
    samples: Samples = {c.name: [] for c in contenders}
    for i in range(repeats):
        for c in contenders if i % 2 == 0 else contenders[::-1]:
            wipe()
            start = time.perf_counter()
            c.run()
            samples[c.name].append(time.perf_counter() - start)
    return samples


def torch_adam(params: list[torch.nn.Parameter], **kwargs: Any) -> torch.optim.Optimizer | None:
    """torch.optim.Adam with ``kwargs``, or None where this torch lacks the variant."""
    try:
        opt = torch.optim.Adam(params, lr=1e-4, **kwargs)
        opt.step()  # fused=True on CPU fails here on torch builds without it
    except (RuntimeError, ValueError) as exc:
        print(f"  (torch.optim.Adam({kwargs}) unavailable: {exc})")
        return None
    return opt


def cpu_contenders(n: int, threads: int, parts: int = 5) -> list[Contender]:
    """All CPU rows, in timing order: compared pairs adjacent, slow torch variants last."""
    triad = [torch.randn(n) for _ in range(3)]
    traffic = [torch.randn(n) for _ in range(4)]

    def c_triad(nontemporal: bool) -> Callable[[], object]:
        return lambda: ds_native.stream_triad(
            triad[0],
            triad[1],
            triad[2],
            0.5,
            nontemporal=nontemporal,
            num_threads=threads,
            backend="native",
        )

    # All optimizers step the same params and grads (each with its own state): values do not
    # matter for timing, and one copy keeps the run's memory to ~2 GB of state at 50M params.
    sizes = split_sizes(n, parts)
    params = make_params(sizes)
    ours = ds_optim.CPUAdam(params, lr=1e-4, num_threads=threads)
    copies = [torch.empty(s, dtype=torch.bfloat16) for s in sizes]
    rows = [
        Contender(
            TRAFFIC,
            lambda: ds_native.stream_adam_traffic(
                traffic[0],
                traffic[1],
                traffic[2],
                traffic[3],
                1e-9,
                num_threads=threads,
                backend="native",
            ),
            ADAM_BYTES * n,
            "bound",
        ),
        Contender(OURS, ours.step, ADAM_BYTES * n, "adam"),
    ]
    fused = torch_adam(params, fused=True)
    if fused is not None:
        rows.append(Contender(TORCH_FUSED, fused.step, ADAM_BYTES * n, "adam"))
    rows += [
        Contender("STREAM triad, ds_native C", c_triad(False), TRIAD_BYTES * n, "bound"),
        Contender(
            "STREAM triad, torch.add(out=)",
            lambda: torch.add(triad[1], triad[2], alpha=0.5, out=triad[0]),
            TRIAD_BYTES * n,
            "bound",
        ),
        Contender(RAW, c_triad(True), TRIAD_BYTES * n, "bound"),
        Contender(
            OURS_COPY, lambda: ours.step(fp16_param_groups=[copies]), COPY_BYTES * n, "offload"
        ),
    ]
    if fused is not None:

        def fused_then_copy() -> None:
            fused.step()
            torch._foreach_copy_(copies, [p.detach() for p in params])

        rows.append(Contender(TORCH_COPY, fused_then_copy, COPY_BYTES * n, "offload"))
    for name, kwargs in ((TORCH_DEFAULT, {}), ("torch Adam (foreach=True)", {"foreach": True})):
        opt = torch_adam(params, **kwargs)
        if opt is not None:
            rows.append(Contender(name, opt.step, ADAM_BYTES * n, "adam"))
    return rows


def cuda_contenders(n: int) -> list[Contender]:
    from ds_optim import FusedAdam  # another engineer's optimizer: imported only with a GPU

    def synced(step: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            step()
            torch.cuda.synchronize()

        return run

    ours = FusedAdam(make_params(split_sizes(n), "cuda"), lr=1e-4)
    theirs = torch.optim.AdamW(make_params(split_sizes(n), "cuda"), lr=1e-4, fused=True)
    return [
        Contender("ds_optim.FusedAdam (cuda)", synced(ours.step), ADAM_BYTES * n, "gpu"),
        Contender("torch AdamW (fused=True, cuda)", synced(theirs.step), ADAM_BYTES * n, "gpu"),
    ]


def gbps(c: Contender, seconds: float) -> float:
    return c.nbytes / seconds / 1e9


def round_bounds(rows: list[Contender], samples: Samples) -> list[float]:
    """Each round's bound: the best GB/s of the bound candidates (the raw triad excluded)."""
    candidates = [c for c in rows if c.table == "bound" and c.name != RAW]
    rounds = range(len(samples[candidates[0].name]))
    return [max(gbps(c, samples[c.name][r]) for c in candidates) for r in rounds]


def print_table(
    table: str, rows: list[Contender], samples: Samples, n: int, bounds: tuple[float, float]
) -> None:
    """Medians per row, GB/s as a share of ``bounds`` (the bound, the raw bandwidth; 0: none)."""
    print(f"\n{TABLES[table]}")
    header = (
        f"  {'':40} {'ms/step':>9} {'ns/param':>9} {'GB/s':>7} {'% of bound':>11} {'% of raw':>9}"
    )
    print(header)
    print("  " + "-" * (len(header) - 2))
    for c in (c for c in rows if c.table == table):
        s = statistics.median(samples[c.name])
        shares = [f"{gbps(c, s) / b:.1%}" if b else "-" for b in bounds]
        print(
            f"  {c.name:40} {s * 1e3:9.2f} {s / n * 1e9:9.3f} {gbps(c, s):7.1f}"
            f" {shares[0]:>11} {shares[1]:>9}"
        )


def verdict(label: str, per_round: list[float], target: float, fmt: str) -> bool:
    value = statistics.median(per_round)
    ok = value >= target
    spread = f"[{format(min(per_round), fmt)}, {format(max(per_round), fmt)}]"
    print(f"  {label:48} {format(value, fmt):>7} {spread:>17}  (target >= "
          f"{format(target, fmt)})  {'PASS' if ok else 'FAIL'}")  # fmt: skip
    return ok


def print_targets(rows: list[Contender], samples: Samples, bounds: list[float]) -> None:
    names = {c.name: c for c in rows}
    ours = samples[OURS]
    print("\ntargets (median over rounds of each round's ratio [min, max])")
    share = [gbps(names[OURS], t) / b for t, b in zip(ours, bounds)]
    verdict("CPUAdam, share of the memory bound", share, SHARE_TARGET, ".1%")
    for name, target in ((TORCH_FUSED, 1.1), (TORCH_DEFAULT, 3.0)):
        if name in samples:
            ratios = [theirs / mine for theirs, mine in zip(samples[name], ours)]
            verdict(f"CPUAdam speed-up over {name}", ratios, target, ".2f")
    if TORCH_COPY in samples:
        ratios = [b / a for a, b in zip(samples[OURS_COPY], samples[TORCH_COPY])]
        verdict("CPUAdam + fused copy-out over fused + copy_", ratios, 1.3, ".2f")


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


@dataclass(frozen=True)
class Case:
    """One CPU case: ``n`` params in ``parts`` tensors, stepped on ``threads`` threads."""

    n: int
    parts: int
    threads: int

    @property
    def label(self) -> str:
        shape = "1 tensor" if self.parts == 1 else f"{self.parts} tensors"
        return f"{self.n / 1e6:g}M params in {shape}, {self.threads} thread(s)"


@dataclass(frozen=True)
class Summary:
    """A case's headline numbers: medians over rounds (ratios: [min, max] too)."""

    case: Case
    ours_ns: float
    fused_ns: float
    floor_ns: float
    speedup: list[float]
    share: list[float]


def run_case(case: Case, repeats: int) -> Summary:
    """Times and prints one case's tables and targets; returns its summary row."""
    torch.set_num_threads(case.threads)
    print(f"\n=== {case.label}, {repeats} rounds after {WARMUP} warm-up rounds ===")
    rows = cpu_contenders(case.n, case.threads, case.parts)
    samples = time_rounds(rows, repeats)
    bounds = round_bounds(rows, samples)
    bound = statistics.median(bounds)
    raw = gbps(next(c for c in rows if c.name == RAW), statistics.median(samples[RAW]))
    for table in ("bound", "adam", "offload"):
        print_table(table, rows, samples, case.n, (bound, raw))
        if table == "bound":
            print(f"  => bound {bound:.1f} GB/s: Adam floor {ADAM_BYTES / bound:.3f} ns/param")
    print_targets(rows, samples, bounds)
    ours = samples[OURS]
    fused = samples.get(TORCH_FUSED, [])
    return Summary(
        case,
        statistics.median(ours) / case.n * 1e9,
        statistics.median(fused) / case.n * 1e9 if fused else float("nan"),
        ADAM_BYTES / bound,
        [theirs / mine for theirs, mine in zip(fused, ours)],
        [ADAM_BYTES * case.n / t / 1e9 / b for t, b in zip(ours, bounds)],
    )


def print_summary(rows: list[Summary]) -> None:
    """One line per case: CPUAdam against torch's fused Adam and the memory floor."""
    print("\nsummary (medians over rounds; [min, max] of the per-round ratio)")
    header = (
        f"  {'case':42} {'ds ns/p':>8} {'fused ns/p':>10} {'floor ns/p':>10}"
        f" {'x torch fused':>20} {'% of bound':>22}"
    )
    print(header)
    print("  " + "-" * (len(header) - 2))
    for r in rows:
        speed = (
            f"{statistics.median(r.speedup):.2f} [{min(r.speedup):.2f},{max(r.speedup):.2f}]"
            if r.speedup
            else "-"
        )
        share = f"{statistics.median(r.share):.0%} [{min(r.share):.0%},{max(r.share):.0%}]"
        print(
            f"  {r.case.label:42} {r.ours_ns:8.3f} {r.fused_ns:10.3f} {r.floor_ns:10.3f}"
            f" {speed:>20} {share:>22}"
        )
    print(f"  targets: >= 1.10x torch fused and >= {SHARE_TARGET:.0%} of the bound in every case")


def parse_ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--params", type=int, default=50_000_000, help="split model size (fp32)")
    parser.add_argument(
        "--single-params", type=int, default=20_000_000, help="single-tensor model size (fp32)"
    )
    parser.add_argument(
        "--layouts", default="split,single", help="comma list of split (5 tensors), single"
    )
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds")
    parser.add_argument(
        "--threads",
        type=parse_ints,
        default=None,
        help="comma list of thread counts (default: 1 and torch's count)",
    )
    args = parser.parse_args(argv)
    threads = args.threads or sorted({1, torch.get_num_threads()})
    layouts = {"split": (args.params, 5), "single": (args.single_params, 1)}
    unknown = [name for name in args.layouts.split(",") if name not in layouts]
    if unknown:
        parser.error(f"--layouts: unknown {unknown}; use split and/or single")
    info = ds_native.build_info()
    if not info["available"]:
        parser.error(f"ds_native's C extension is not built: {info['reason']}")
    print(
        f"CPU: {cpu_name()}; SIMD level {info['simd_level']}, CPUAdam path {info['adam_simd']}"
        f" ({info['compiler']}, {' '.join(info['compile_args'] or [])}); torch {torch.__version__}"
    )
    cases = [Case(*layouts[name], t) for name in args.layouts.split(",") for t in threads]
    summaries = [run_case(case, args.repeats) for case in cases]
    print_summary(summaries)

    if torch.cuda.is_available():
        n = args.params
        gpu = cuda_contenders(n)
        gpu_samples = time_rounds(gpu, args.repeats)
        print_table("gpu", gpu, gpu_samples, n, (0.0, 0.0))
        ratios = [b / a for a, b in zip(gpu_samples[gpu[0].name], gpu_samples[gpu[1].name])]
        print(
            f"  FusedAdam speed-up over torch AdamW(fused=True): {statistics.median(ratios):.2f}x"
        )
    print("\n(shared or loaded machines make single runs noisy: rerun before trusting a FAIL)")


if __name__ == "__main__":
    main()
