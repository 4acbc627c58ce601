"""ds against real DeepSpeed on one GPU: tokens/s and peak memory of a GPT at ZeRO-2/3 and with
ZeRO-Offload, and ds's FusedAdam against torch's fused Adam.

Needs CUDA; prints why and exits 0 without it. Each (system, setting) trains in a fresh process,
so each peak-memory figure is its own: the same GPT-style model (``--params`` million
parameters, bf16, ``--seq`` tokens, ``--micro-batch`` sequences per step), the same random
tokens, the same optimizer on both sides (``torch.optim.AdamW`` through the config's
``"torch_adam": true``, so no system wins by its kernel and real DeepSpeed needs no JIT build),
on one rank with the NCCL backend. ``deepspeed`` must be the real DeepSpeed (installed with
``DS_BUILD_OPS=0``); without it only ds's rows are printed.

Goals (issue 18): ds's tokens/s >= DeepSpeed's and ds's peak memory <= DeepSpeed's in every row,
and the largest model trainable with ZeRO-Offload at least DeepSpeed's. That last one is
projected, not searched for (a search means many multi-billion-parameter runs): each run reports
its device peak and its host growth per parameter, and the machine's device and host memory
divided by those bounds the model (``largest_trainable``); both systems are projected the same
way from their own runs.

Usage (from the workspace root, on a GPU machine)::

    python tools/bench/gpu.py                       # ~1B params, ZeRO-2, ZeRO-3, offload, Adam
    python tools/bench/gpu.py --params 125 --steps 5 --settings zero2   # a quick look
    python tools/bench/gpu.py --settings zero2-offload --phases --profile /tmp/prof  # where it goes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

SETTINGS = {
    "zero2": {"stage": 2, "offload": False},
    "zero3": {"stage": 3, "offload": False},
    "zero2-offload": {"stage": 2, "offload": True},
}
GIB = 1 << 30


def _gpt(vocab: int, dim: int, layers: int, seq: int) -> Any:
    import torch
    import torch.nn.functional as F
    from torch import nn

    class GPT(nn.Module):
        """Decoder-only transformer with causal pre-norm blocks and a tied head."""

        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            nn.init.normal_(self.embed.weight, std=0.02)
            self.position = nn.Parameter(torch.zeros(seq, dim))
            block = nn.TransformerEncoderLayer(
                dim, dim // 128, 4 * dim, dropout=0.0, activation="gelu", batch_first=True,
                norm_first=True,
            )  # fmt: skip
            self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(dim)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.embed(tokens[:, :-1]) + self.position
            x = self.blocks(x, is_causal=True, mask=_causal(seq, x))
            logits = F.linear(self.norm(x), self.embed.weight).float()
            return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def _causal(n: int, x: torch.Tensor) -> torch.Tensor:
        return nn.Transformer.generate_square_subsequent_mask(n, device=x.device, dtype=x.dtype)

    return GPT()


def _width(params_m: float, layers: int, vocab: int) -> int:
    """The width (a multiple of 128) giving about ``params_m`` million parameters."""
    target = params_m * 1e6
    dim = 128
    while 12 * (dim + 128) ** 2 * layers + vocab * (dim + 128) <= target:
        dim += 128
    return dim


def _config(setting: str, micro_batch: int) -> dict[str, Any]:
    spec = SETTINGS[setting]
    zero: dict[str, Any] = {"stage": spec["stage"], "overlap_comm": True}
    if spec["offload"]:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 1_000_000,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
    }


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    """One training run in this process; returns its figures."""
    import torch

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 1000))
    if args.system == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", args.device)
        import deepspeed as engine_lib
    else:
        import ds_engine as engine_lib
    cuda = args.device == "cuda"
    engine_lib.init_distributed(dist_backend="nccl" if cuda else "gloo")
    host_before = _host_resident_bytes()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    dim = _width(args.params, args.layers, args.vocab)
    with device:  # built in place: a 1B model is slow to initialise on the host
        model = _gpt(args.vocab, dim, args.layers, args.seq - 1)
    n_params = sum(p.numel() for p in model.parameters())
    engine, *_ = engine_lib.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=_config(args.setting, args.micro_batch),
    )
    gen = torch.Generator(device=device).manual_seed(1)
    batch = torch.randint(0, args.vocab, (args.micro_batch, args.seq), device=device, generator=gen)
    times, losses = [], []
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "step": []}
    peak_backward = peak_step = 0
    _peak_since_reset(cuda)  # building the engine is not a training step
    for step in range(args.warmup + args.steps):
        sync()
        start = time.perf_counter()
        loss = engine(batch)
        ends = [_phase_end(args.phases, sync)]
        engine.backward(loss)
        ends.append(_phase_end(args.phases, sync))
        peak_backward = max(peak_backward, _peak_since_reset(cuda))
        engine.step()
        peak_step = max(peak_step, _peak_since_reset(cuda))
        sync()
        ends.append(time.perf_counter())
        if step >= args.warmup:
            times.append(ends[-1] - start)
            for name, begin, end in zip(phases, [start, *ends], ends):
                phases[name].append(end - begin)
        losses.append(float(loss.detach()))
    if args.profile:
        _profile_one_step(
            engine, batch, cuda, f"{args.profile}/profile_{args.system}_{args.setting}.txt"
        )
    median = statistics.median_high(times)
    return {
        "system": args.system,
        "setting": args.setting,
        "params": n_params,
        "tokens_per_s": args.micro_batch * (args.seq - 1) / median,
        "step_s": median,
        "peak_gib": max(peak_backward, peak_step) / GIB if cuda else float("nan"),
        "peak_backward_gib": peak_backward / GIB if cuda else float("nan"),
        "peak_step_gib": peak_step / GIB if cuda else float("nan"),
        "reserved_gib": torch.cuda.max_memory_reserved() / GIB if cuda else float("nan"),
        "host_gib": (_host_peak_bytes() - host_before) / GIB,
        "device_total_gib": torch.cuda.get_device_properties(device).total_memory / GIB
        if cuda
        else float("nan"),
        "host_total_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "phases_s": {name: statistics.median_high(values) for name, values in phases.items()}
        if args.phases
        else None,
    }


def _phase_end(synchronise: bool, sync: Any) -> float:
    """The time a phase ended: after the device caught up with it when phases are timed (the
    synchronisation costs the overlap between phases, so it is off unless asked for)."""
    if synchronise:
        sync()
    return time.perf_counter()


def _profile_one_step(engine: Any, batch: Any, cuda: bool, path: str) -> None:
    """One more training step under torch.profiler; the ops that took the most host time and
    the most device time go to ``path`` (where a slow step spends itself, per system)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with profile(activities=activities) as prof:
        with record_function("bench.forward"):
            loss = engine(batch)
            sync()
        with record_function("bench.backward"):
            engine.backward(loss)
            sync()
        with record_function("bench.step"):
            engine.step()
            sync()
    averages = prof.key_averages()
    tables = [averages.table(sort_by="self_cpu_time_total", row_limit=40)]
    if cuda:
        tables.append(averages.table(sort_by="self_device_time_total", row_limit=25))
    with open(path, "w") as out:
        out.write("\n\n".join(tables))


def _host_resident_bytes() -> int:
    """This process's resident host memory now."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _host_peak_bytes() -> int:
    """This process's peak resident host memory (pinned buffers included)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def largest_trainable(row: dict[str, Any]) -> float:
    """Parameters (billions) of the largest model of this shape that fits, projected from
    this run: the device and the host each hold bytes per parameter as measured here (device:
    the peak, activations included, so the projection is conservative; host: the growth of the
    resident set), and whichever runs out first bounds the model. Both systems are projected
    the same way from their own runs."""
    params = row["params"]
    device = row["device_total_gib"] / (row["peak_gib"] / params)
    host = row["host_total_gib"] / max(row["host_gib"] / params, 1e-12)
    return min(device, host) / 1e9


def _peak_since_reset(cuda: bool) -> int:
    """Peak allocated bytes since the last call (0 on the CPU), so forward+backward and the
    optimizer step each get their own peak: which phase sets the peak says what to shrink."""
    import torch

    if not cuda:
        return 0
    peak = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    return peak


def _adam_bench(numel_m: float, steps: int) -> list[dict[str, Any]]:
    """ds FusedAdam (Triton) against torch.optim.AdamW(fused=True) on one flat bf16/fp32 set."""
    import torch

    from ds_optim import FusedAdam

    rows = []
    for name in ("torch fused AdamW", "ds FusedAdam"):
        torch.manual_seed(0)
        params = [
            torch.nn.Parameter(torch.randn(int(numel_m * 1e6) // 8, device="cuda"))
            for _ in range(8)
        ]
        for p in params:
            p.grad = torch.randn_like(p)
        if name.startswith("torch"):
            opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
        else:
            opt = FusedAdam(params, lr=1e-3)
        for _ in range(3):
            opt.step()
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            opt.step()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / steps
        # Adam reads p, g, m, v and writes p, m, v: 7 fp32 words per element.
        rows.append({"optimizer": name, "ms": ms, "gb_s": 7 * 4 * numel_m * 1e6 / ms / 1e6})
    return rows


def _run(args: argparse.Namespace, system: str, setting: str) -> dict[str, Any] | str:
    cmd = [sys.executable, __file__, "--worker", "--system", system, "--setting", setting]
    for key in ("params", "layers", "vocab", "seq", "micro_batch", "steps", "warmup"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    cmd += ["--phases"] if args.phases else []
    cmd += ["--profile", args.profile] if args.profile else []
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    lines = (proc.stderr or proc.stdout).strip().splitlines()
    errors = [line for line in lines if "Error" in line] or lines[-1:]
    return "failed: " + errors[-1].strip()[:200]


def _real_deepspeed_present() -> bool:
    probe = "import deepspeed, sys; sys.exit(0 if hasattr(deepspeed, 'DeepSpeedEngine') and 'ds_engine' not in repr(deepspeed.initialize.__module__) else 1)"
    env = {**os.environ, "DS_ACCELERATOR": "cuda"}
    return (
        subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True).returncode == 0
    )


def _table(rows: list[dict[str, Any] | str], settings: list[str], systems: list[str]) -> str:
    lines = [
        "| setting | system | params | tokens/s | step (s) | peak alloc (GiB) | peak fwd+bwd / step (GiB) "
        "| host (GiB) | largest model, projected (B) | loss first -> last |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    it = iter(rows)
    for setting in settings:
        for system in systems:
            row = next(it)
            if isinstance(row, str):
                lines.append(f"| {setting} | {system} | | {row} | | | | | | |")
                continue
            lines.append(
                f"| {setting} | {system} | {row['params'] / 1e6:.0f}M | {row['tokens_per_s']:.0f} | "
                f"{row['step_s']:.3f} | {row['peak_gib']:.2f} | "
                f"{row['peak_backward_gib']:.2f} / {row['peak_step_gib']:.2f} | "
                f"{row['host_gib']:.1f} | {largest_trainable(row):.1f} | "
                f"{row['first_loss']:.3f} -> {row['last_loss']:.3f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=1000, help="model size, millions")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=1025)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--adam-millions", type=float, default=256.0)
    parser.add_argument("--timeout", type=float, default=240.0)
    parser.add_argument(
        "--phases",
        action="store_true",
        help="also time forward, backward and step apart (synchronising between them)",
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="profile one extra step per run; write DIR/profile_<system>_<setting>.txt",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", default="ds", help=argparse.SUPPRESS)
    parser.add_argument("--setting", default="zero2", help=argparse.SUPPRESS)
    # A worker on the CPU (gloo) checks the script itself where no GPU is at hand.
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(_worker(args)), flush=True)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("tools/bench/gpu.py: no CUDA device here; nothing measured")
        return 0
    systems = ["ds"] + (["deepspeed"] if _real_deepspeed_present() else [])
    print(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; systems: {systems}")
    rows = []
    for setting in args.settings:
        for system in systems:
            rows.append(_run(args, system, setting))
            print(f"# {setting} {system}: {rows[-1]}", flush=True)  # kept if a later run hangs
    print(_table(rows, args.settings, systems))
    if args.phases:
        print(
            "\n| setting | system | forward (s) | backward (s) | step (s) |\n|---|---|---|---|---|"
        )
        for row in rows:
            if isinstance(row, dict) and row.get("phases_s"):
                times = row["phases_s"]
                print(
                    f"| {row['setting']} | {row['system']} | {times['forward']:.3f} | "
                    f"{times['backward']:.3f} | {times['step']:.3f} |"
                )
    if args.adam_millions <= 0:
        return 0
    print("\n| optimizer | ms/step | effective GB/s |\n|---|---|---|")
    for row in _adam_bench(args.adam_millions, 20):
        print(f"| {row['optimizer']} | {row['ms']:.2f} | {row['gb_s']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
