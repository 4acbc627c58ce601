"""What verifying while copying costs: ds_native's CRC-32 kernels against zlib and a plain copy.

For a buffer of ``--mb`` megabytes split into ``--tensors`` spans (a shard file's fp32 masters,
as ds-zero's checksum threads see them), each of ``--repeats`` rounds times, next to each other
and in alternating order:

* ``zlib.crc32`` of each span (the peer: what Python gives);
* ``ds_native.crc32_spans``: the same CRC-32s in one native call;
* the same with the code path named (``simd=``, the widest this CPU runs): what
  ``crc32_copy_spans`` does for each 64 KiB block it hashes. Each call once asked the CPU (cpuid,
  trapped by a virtual machine's hypervisor) whether it runs the path; the answer is now kept
  ([Note: cpuid asked once] in kernels/ds-native/csrc/cpu_features.c), so this row and the one above
  should be level;
* a copy of each span into a tensor of its own (``torch.Tensor.copy_``), what a loader does;
* ``ds_native.crc32_copy_spans``: the copies and the CRC-32s in one pass
  ([Note: copying while hashing] in kernels/ds-native/csrc/crc32.c);
* the same into one buffer at each span's offset (``at=``), as ds-zero's copying jobs call it:
  one destination checked a call instead of one a span (with many small spans, ``--mb 0.05
  --tensors 762``, the Python work of the call, which holds the GIL, is the difference).

The destination tensors are allocated once and reused, as the allocator hands a later load the
memory an earlier one freed (new pages would add their faults to every copying row alike). The
table gives the median milliseconds and GB/s of each, and what hashing adds to the copy.

Usage (from the workspace root)::

    OMP_NUM_THREADS=1 .venv/bin/python tools/bench/crc32.py --mb 40 --tensors 10
    OMP_NUM_THREADS=1 .venv/bin/python tools/bench/crc32.py --mb 0.05 --tensors 762
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import zlib


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--mb", type=float, default=40.0, help="megabytes hashed per round")
    parser.add_argument("--tensors", type=int, default=10, help="spans the buffer is split into")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    if args.mb <= 0 or args.tensors < 1 or args.repeats < 1:
        parser.error(
            f"--mb {args.mb}, --tensors {args.tensors}, --repeats {args.repeats}: "
            "give a positive size and at least one span and one round"
        )
    import torch

    import ds_native

    span = max(4, int(args.mb * 1e6) // args.tensors // 4 * 4)
    data = bytearray(os.urandom(span * args.tensors))
    source = torch.frombuffer(data, dtype=torch.uint8)
    spans = [(i * span, span) for i in range(args.tensors)]
    outs = [torch.empty(span, dtype=torch.uint8) for _ in spans]
    one = torch.empty(span * args.tensors, dtype=torch.uint8)
    places = [i * span for i in range(args.tensors)]
    view = memoryview(data)

    def zlib_each() -> None:
        for a, n in spans:
            zlib.crc32(view[a : a + n])

    def copies() -> None:
        for (a, n), out in zip(spans, outs):
            out.copy_(source[a : a + n])

    native = ds_native.native_available()
    widest = next(
        (p for p in ("vpclmul", "pclmul") if native and ds_native.crc32_simd_supported(p)), None
    )
    contenders = {
        "zlib.crc32, each span": zlib_each,
        "ds_native.crc32_spans": lambda: ds_native.crc32_spans(data, spans),
    }
    if widest is not None:
        contenders[f"ds_native.crc32_spans, simd={widest!r}"] = lambda: ds_native.crc32_spans(
            data, spans, simd=widest
        )
    contenders |= {
        "copy (torch copy_)": copies,
        "ds_native.crc32_copy_spans": lambda: ds_native.crc32_copy_spans(data, spans, outs),
        "ds_native.crc32_copy_spans, one buffer (at=)": lambda: ds_native.crc32_copy_spans(
            data, spans, one, at=places
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for round_ in range(args.repeats + 2):  # two warm-up rounds
        for name in names if round_ % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            contenders[name]()
            if round_ >= 2:
                times[name].append(time.perf_counter() - start)
    total = span * args.tensors
    print(
        f"\n{total / 1e6:.1f} MB in {args.tensors} spans, median of {args.repeats} rounds, "
        f"ds-native's C extension {'built' if ds_native.native_available() else 'absent (zlib)'}"
    )
    print("| what | ms | GB/s |")
    print("|---|---|---|")
    median = {name: statistics.median(values) for name, values in times.items()}
    for name in names:
        print(f"| {name} | {median[name] * 1e3:.2f} | {total / median[name] / 1e9:.1f} |")
    added = median["ds_native.crc32_copy_spans"] - median["copy (torch copy_)"]
    print(
        f"\nhashing while copying adds {added * 1e3:+.2f} ms to the copy "
        f"({100 * added / median['copy (torch copy_)']:+.0f}%)"
    )


if __name__ == "__main__":
    main()
