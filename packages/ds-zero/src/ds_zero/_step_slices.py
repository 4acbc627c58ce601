"""``step_in_slices``: the wrapped optimizer stepped over cache-sized slices of a flat CPU
master, as both ZeRO layouts step it (see [Note: stepping a flat master in slices])."""

from __future__ import annotations

from typing import Any, TypeGuard

import torch
import torch.optim.optimizer as torch_optimizer_module

import ds_optim
from ds_zero._adam_replay import replay_adam_in_slices

__all__ = ["STEP_SLICE_NUMEL", "step_in_slices", "step_slice_numel"]

# [Note: stepping a flat master in slices]
# On CPU, torch's optimizers (unfused) and ds-optim's FusedAdam and Lion (``torch._foreach_*``)
# run one kernel per operation over a whole tensor, several of which allocate a temporary as
# large as it (Adam's ``exp_avg_sq.sqrt()`` and the division after it). For a flat master of
# 100M fp32 elements each is 400 MB, which glibc maps fresh from the kernel (above 32 MB it
# always does): every step page-faults through it, and each operation streams the whole buffer
# through memory. A DDP loop steps per parameter, with smaller temporaries and some cache reuse;
# the whole flat step was 1.5x slower (tools/bench/engine.py's AdamW: ~660 against ~440 ms).
# So on CPU the wrapped optimizer steps consecutive slices of ``STEP_SLICE_NUMEL`` elements of
# every group's master: each param group holds one slice at a time, whose gradient and
# elementwise state (tensors shaped like the master) are views into the flat tensors, updated
# in place, and whose scalar state (Adam's ``step``) is a copy of the value before the step;
# every slice advances it the same way and the first slice's result is kept. The update is
# elementwise, so the result is exactly the whole step's (tested bit for bit) and the state
# dict keeps one flat tensor per group. Only optimizers known to be elementwise are sliced
# (``_SLICEABLE``, exact types: a subclass may add a per-tensor rule), never their fused
# kernels (one pass, no temporaries), nor the first step (it creates the state, flat), nor an
# optimizer with step hooks (a hook means "once per step"; it would run once per slice).
# 2**17 to 2**18 elements (0.5-1 MiB of fp32: in a core's L2 cache with their state) measured
# fastest: AdamW over 100M elements took ~0.35 s against ~0.6 s whole (2**16: 0.40 s, 2**20:
# 0.47 s), FusedAdam 0.31 s against 0.44 s. torch's Adam and AdamW are not stepped through their
# ``step`` per slice but replayed (see [Note: replaying torch's Adam over slices]).

# That was 2 threads. Each elementwise op splits its slice among the intra-op threads, so with
# more threads a slice of that size leaves each thread too little to amortise the op's launch:
# the slice grows with the threads beyond 2 (``step_slice_numel``), keeping each thread's share.
STEP_SLICE_NUMEL = 1 << 18


def step_slice_numel() -> int:
    """Elements per optimizer slice for this process's intra-op thread count."""
    return STEP_SLICE_NUMEL * max(1, torch.get_num_threads() // 2)


_SLICEABLE = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
    torch.optim.RMSprop,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adadelta,
    ds_optim.FusedAdam,
    ds_optim.Lion,
)


def _sliceable_masters(
    optimizer: torch.optim.Optimizer, numel: int
) -> list[torch.Tensor | None] | None:
    """Each param group's master (None for an empty group) when the step can be sliced, else
    None (see [Note: stepping a flat master in slices])."""
    if type(optimizer) not in _SLICEABLE or _has_step_hooks(optimizer):
        return None
    masters: list[torch.Tensor | None] = []
    for group in optimizer.param_groups:
        params = group["params"]
        if not params:
            masters.append(None)
            continue
        master = params[0]
        state = optimizer.state.get(master)
        if (
            len(params) != 1
            or group.get("fused")
            or group.get("differentiable")
            or master.device.type != "cpu"
            or master.dim() != 1
            or master.grad is None
            or not state  # the first step creates the state
            or any(_elementwise(v) and v.shape != master.shape for v in state.values())
        ):
            return None
        masters.append(master)
    longest = max((m.numel() for m in masters if m is not None), default=0)
    return masters if longest > numel else None


def step_in_slices(optimizer: torch.optim.Optimizer, numel: int = STEP_SLICE_NUMEL) -> bool:
    """Step ``optimizer`` over slices of ``numel`` elements of each group's flat master, when
    it can be (see [Note: stepping a flat master in slices]); return whether it did.

    Example:
        >>> if not step_in_slices(optimizer):  # param groups of one flat CPU master each
        ...     optimizer.step()
    """
    masters = _sliceable_masters(optimizer, numel)
    if masters is None:
        return False
    if replay_adam_in_slices(optimizer, masters, numel):  # torch's Adam/AdamW, no step() calls
        return True
    groups, state = optimizer.param_groups, optimizer.state
    before = {id(m): dict(state[m]) for m in masters if m is not None}
    first: dict[int, dict[str, Any]] = {}  # scalar state of each master's first slice
    grown: dict[tuple[int, str], list[torch.Tensor]] = {}  # elementwise state the step added
    live: list[torch.Tensor] = []
    longest = max(m.numel() for m in masters if m is not None)
    try:
        for start in range(0, longest, numel):
            stepped = []
            for group, master in zip(groups, masters):
                group["params"] = []
                if master is None or start >= master.numel():
                    continue
                length = min(numel, master.numel() - start)
                piece, grad = master.narrow(0, start, length), master.grad
                assert grad is not None  # checked by _sliceable_masters
                piece.grad = grad.narrow(0, start, length)
                state[piece] = {
                    k: v.narrow(0, start, length) if _elementwise(v) else _copy(v)
                    for k, v in before[id(master)].items()
                }
                group["params"] = [piece]
                live.append(piece)
                stepped.append((master, piece, start, length))
            optimizer.step()
            for master, piece, start, length in stepped:
                for key, value in state.pop(piece).items():
                    kept = before[id(master)].get(key)
                    if _elementwise(kept):
                        target = kept.narrow(0, start, length)
                        if value.data_ptr() != target.data_ptr():  # replaced, not updated
                            target.copy_(value)
                    elif _elementwise(value):
                        grown.setdefault((id(master), key), []).append(value)
                    elif start == 0:
                        first.setdefault(id(master), {})[key] = value
    finally:
        for group, master in zip(groups, masters):
            group["params"] = [master] if master is not None else []
        for piece in live:
            state.pop(piece, None)
    for master in masters:
        if master is not None:
            state[master].update(first.get(id(master), {}))
            for (owner, key), pieces in grown.items():
                if owner == id(master):
                    state[master][key] = torch.cat(pieces)
    return True


def _has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    return bool(
        getattr(optimizer, "_optimizer_step_pre_hooks", None)
        or getattr(optimizer, "_optimizer_step_post_hooks", None)
        # torch's process-wide hooks (private names: read defensively, absent means none)
        or getattr(torch_optimizer_module, "_global_optimizer_pre_hooks", None)
        or getattr(torch_optimizer_module, "_global_optimizer_post_hooks", None)
    )


def _elementwise(value: Any) -> TypeGuard[torch.Tensor]:
    return torch.is_tensor(value) and value.dim() > 0


def _copy(value: Any) -> Any:
    return value.clone() if torch.is_tensor(value) else value
