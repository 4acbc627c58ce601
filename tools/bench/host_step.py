"""ZeRO-Offload's host step: torch's AdamW over one flat fp32 master, whole against in slices.

Under ``offload_optimizer`` with a torch optimizer, the step runs on the host over one flat fp32
partition per param group. DeepSpeed steps it whole: each of AdamW's elementwise ops streams the
whole partition through memory, and ``exp_avg_sq.sqrt()`` and the division after it allocate
temporaries as large as it. ds steps cache-sized slices of it (``ds_zero``'s
``step_in_slices``, see its [Note: stepping a flat master in slices]), whose slice grows with
the intra-op threads (``step_slice_numel``). This script times both on one master of
``--params`` million elements at each ``--threads`` count, with each slice size in ``--slices``
(powers of two) beside ds's default, and ds-optim's ``CPUAdam`` (one fused C pass) for scale.

Every contender steps the same tensors in turn (the values drift; the work does not), after
one warm-up step each, for ``--rounds`` rounds; cells are the median ns/param, and "x whole"
is the whole step's time over the contender's.

Usage (from the workspace root)::

    uv run python tools/bench/host_step.py --params 100 --threads 2
    python tools/bench/host_step.py --params 1000 --threads 8,16 --rounds 3   # a 1B partition
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import ds_optim
from ds_zero._step_slices import step_in_slices, step_slice_numel


def _contenders(params: torch.Tensor, slices: list[int]) -> dict[str, Callable[[], object]]:
    adamw = torch.optim.AdamW([params], lr=1e-4)
    cpu_adam = ds_optim.CPUAdam([params], lr=1e-4, adamw_mode=True)
    found: dict[str, Callable[[], object]] = {"whole (DeepSpeed)": adamw.step}
    default = step_slice_numel()
    found[f"ds default (2^{default.bit_length() - 1})"] = lambda: step_in_slices(adamw, default)
    for log2 in slices:
        found[f"slices 2^{log2}"] = lambda n=1 << log2: step_in_slices(adamw, n)
    found["CPUAdam"] = cpu_adam.step
    adamw.step()  # the first step creates the state, flat; slicing starts after it
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "ZeRO-Offload host step").splitlines()[0]
    )
    parser.add_argument("--params", type=float, default=100.0, help="master size, millions")
    parser.add_argument("--threads", default=str(torch.get_num_threads()))
    parser.add_argument("--slices", default="18,20,22,24", help="log2 slice sizes")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    numel = int(args.params * 1e6)
    slices = [int(s) for s in args.slices.split(",") if s]
    print(f"host step over one fp32 master of {numel / 1e6:.0f}M elements; ns/param, median")
    print("\n| threads | contender | ns/param | x whole |\n|---|---|---|---|")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        torch.manual_seed(0)
        params = torch.nn.Parameter(torch.randn(numel) * 0.02)
        params.grad = torch.randn(numel) * 1e-3
        contenders = _contenders(params, slices)
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for step in contenders.values():  # warm-up
            step()
        for _ in range(args.rounds):
            for name, step in contenders.items():
                start = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - start)
        medians = {name: statistics.median_high(t) for name, t in times.items()}
        whole = medians["whole (DeepSpeed)"]
        for name, seconds in medians.items():
            print(f"| {threads} | {name} | {seconds / numel * 1e9:.3f} | {whole / seconds:.2f} |")
        del contenders, params
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
