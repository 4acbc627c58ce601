"""This machine's devices: visible GPU ids, usable cores, and each rank's share of the cores.

[Note: finding GPUs without torch]
``import torch`` takes seconds, and ds-launch must start instantly and install without torch. The
GPU ids come, in order, from:

1. ``CUDA_VISIBLE_DEVICES`` when set: its integer ids (empty, or ``-1``: no GPU). The ranks'
   ``CUDA_VISIBLE_DEVICES`` is then rebuilt from the ids each node uses, as DeepSpeed does, so
   UUID entries (``GPU-...``, ``MIG-...``) cannot be honoured and are an error saying so.
2. The NVIDIA device nodes ``/dev/nvidia<N>``. Inside a container these are exactly the GPUs
   mapped into it, where ``/proc/driver/nvidia/gpus`` would list every GPU of the host.
3. On ROCm (``/dev/kfd``), the GPU nodes of the KFD topology in sysfs (those with compute
   units, ``simd_count > 0``), as ``rocm-smi`` counts them. HIP honours ``CUDA_VISIBLE_DEVICES``
   too, so the same variable selects them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

_NVIDIA_NODE = re.compile(r"nvidia(\d+)")
_KFD_NODES = "/sys/class/kfd/kfd/topology/nodes"


def visible_gpu_ids(
    environ: Mapping[str, str], dev_dir: str = "/dev", kfd_nodes: str = _KFD_NODES
) -> list[int]:
    """GPU ids of this machine that ranks may use (see [Note: finding GPUs without torch]).

    Raises:
        ValueError: ``CUDA_VISIBLE_DEVICES`` holds a non-integer entry.
    """
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return _parse_visible(visible)
    try:
        names = os.listdir(dev_dir)
    except OSError:
        return []
    ids = sorted(int(m.group(1)) for m in map(_NVIDIA_NODE.fullmatch, names) if m)
    if ids:
        return ids
    if "kfd" in names:
        return list(range(_rocm_gpu_count(kfd_nodes)))
    return []


def _rocm_gpu_count(kfd_nodes: str) -> int:
    count = 0
    try:
        nodes = os.listdir(kfd_nodes)
    except OSError:
        return 0
    for node in nodes:
        try:
            with open(os.path.join(kfd_nodes, node, "properties"), encoding="ascii") as fd:
                properties = dict(line.split(maxsplit=1) for line in fd if line.strip())
        except (OSError, ValueError):
            continue
        if int(properties.get("simd_count", "0")) > 0:
            count += 1
    return count


def _parse_visible(visible: str) -> list[int]:
    ids: list[int] = []
    for entry in (e.strip() for e in visible.split(",")):
        if not entry:
            continue
        try:
            number = int(entry)
        except ValueError:
            raise ValueError(
                f"CUDA_VISIBLE_DEVICES={visible!r}: entry {entry!r} is not an integer id; "
                "ds-launch maps ranks to integer GPU ids (use `nvidia-smi -L` to find them)"
            ) from None
        if number < 0:
            break  # CUDA stops at the first invalid id: "-1" hides every GPU.
        ids.append(number)
    return ids


def parse_core_list(spec: str) -> list[int]:
    """``"1,3-5,7"`` -> ``[1, 3, 4, 5, 7]`` (order kept, duplicates dropped).

    Raises:
        ValueError: an empty item, a non-number or a descending range.
    """
    cores: list[int] = []
    for item in spec.split(","):
        low, sep, high = item.strip().partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ValueError(f"bad core range {item.strip()!r}; expected a list like 0-3,8,10-11")
        first, last = int(low), int(high) if sep else int(low)
        if last < first:
            raise ValueError(f"descending core range {item.strip()!r}")
        cores.extend(c for c in range(first, last + 1) if c not in cores)
    return cores


def usable_cores() -> list[int]:
    """Cores this process may run on (its affinity mask), else all of them."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def rank_core_shares(cores: list[int], num_ranks: int) -> list[list[int]]:
    """Split ``cores`` into ``num_ranks`` equal contiguous shares (the remainder stays unused, as
    in DeepSpeed's ``--bind_cores_to_rank``).

    Raises:
        ValueError: fewer cores than ranks.
    """
    per_rank = len(cores) // num_ranks
    if per_rank == 0:
        raise ValueError(
            f"{len(cores)} core(s) {cores} cannot be shared by {num_ranks} ranks; "
            "pass a longer --bind_core_list or drop --bind_cores_to_rank"
        )
    return [cores[i * per_rank : (i + 1) * per_rank] for i in range(num_ranks)]
