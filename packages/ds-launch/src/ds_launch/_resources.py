"""Which slots of which hosts a job uses: ``--include``/``--exclude``, ``--num_nodes``/``--num_gpus``.

[Note: resource selection order]
As in DeepSpeed: the pool (hostfile hosts with slots ``0..N-1``, or this machine's visible GPUs)
is filtered by ``--include`` or ``--exclude`` (never both, and never with the counts); then
``--num_nodes N`` keeps the first N hosts, then ``--num_gpus N`` keeps the first N slots of each.
An included host keeps its slots in the order written, so ``-i w:2,0`` puts local rank 0 on
GPU 2. Where DeepSpeed is silent ds-launch is strict: a filter naming an unknown host or slot,
counts larger than the pool, or a selection with no slot left are errors naming them.
"""

from __future__ import annotations

from ds_launch._names import bad_host, host_problem
from ds_launch.api import LaunchError

_NODE_SEP, _SLOT_START, _SLOT_SEP = "@", ":", ","


def _parse_filter(flag: str, spec: str) -> list[tuple[str, list[int] | None]]:
    """``"w1:0,2@w2"`` -> ``[("w1", [0, 2]), ("w2", None)]`` (None: the whole host)."""
    items: list[tuple[str, list[int] | None]] = []
    seen: set[str] = set()
    for node in spec.split(_NODE_SEP):
        host, sep, slot_text = node.strip().partition(_SLOT_START)
        host = host.strip()
        if not host:
            raise LaunchError(f"{flag} {spec!r}: empty host name in {node!r}")
        problem = host_problem(host)
        if problem is not None:  # see [Note: names that cannot inject] in _names.py
            raise LaunchError(f"{flag} {spec!r}: {host!r} is refused: {problem}")
        if host in seen:
            raise LaunchError(
                f"{flag} {spec!r}: host {host!r} appears twice; list its slots once ({host}:0,1)"
            )
        seen.add(host)
        if not sep:
            items.append((host, None))
            continue
        slots: list[int] = []
        for text in slot_text.split(_SLOT_SEP):
            if not text.strip().isdigit():
                raise LaunchError(
                    f"{flag} {spec!r}: slot {text.strip()!r} of {host!r} is not a number "
                    "(syntax: host:0,2@other-host)"
                )
            if int(text) not in slots:
                slots.append(int(text))
        items.append((host, slots))
    return items


def _check_known(flag: str, pool: dict[str, list[int]], pool_name: str, host: str, slots) -> None:
    if host not in pool:
        raise LaunchError(f"{flag}: host {host!r} is not in {pool_name} (hosts: {', '.join(pool)})")
    missing = [s for s in slots or () if s not in pool[host]]
    if missing:
        raise LaunchError(
            f"{flag}: slot(s) {', '.join(map(str, missing))} not on host {host!r} in "
            f"{pool_name} (its slots: {', '.join(map(str, pool[host]))})"
        )


def _apply_filter(
    pool: dict[str, list[int]], include: str, exclude: str, pool_name: str
) -> dict[str, list[int]]:
    flag, spec = ("--include", include) if include else ("--exclude", exclude)
    items = _parse_filter(flag, spec)
    for host, slots in items:
        _check_known(flag, pool, pool_name, host, slots)
    if include:
        chosen = {host: list(pool[host]) if slots is None else slots for host, slots in items}
        # Hosts keep the pool's order, so node ranks follow the hostfile (DeepSpeed does too).
        return {host: chosen[host] for host in pool if host in chosen}
    removed = dict(items)
    kept: dict[str, list[int]] = {}
    for host, slots in pool.items():
        if host in removed:
            drop = removed[host]
            slots = [] if drop is None else [s for s in slots if s not in drop]
        if slots:
            kept[host] = list(slots)
    return kept


def select_resources(
    pool: dict[str, list[int]],
    *,
    include: str = "",
    exclude: str = "",
    num_nodes: int = -1,
    num_gpus: int = -1,
    pool_name: str = "the hostfile",
) -> dict[str, list[int]]:
    """Apply the selection flags to a pool (see [Note: resource selection order]).

    Args:
        pool: ``{host: slots}`` in node order.
        include: ``NODE_SPEC[@NODE_SPEC...]``, ``NODE_SPEC = host[:slot[,slot...]]``.
        exclude: the same syntax; what to leave out.
        num_nodes: keep the first N hosts (-1: all).
        num_gpus: keep the first N slots of every host (-1: all).
        pool_name: how error messages name the pool (``the hostfile hosts``...).

    Returns:
        ``{host: slots}`` of the job, in node order.

    Raises:
        LaunchError: a bad spec, an unknown host or slot, a pool or spec host that is not a
            host name or IP address, counts beyond the pool, or nothing left.

    Example:
        >>> pool = {"worker-1": [0, 1, 2, 3], "worker-2": [0, 1, 2, 3]}
        >>> select_resources(pool, include="worker-1:0,2@worker-2")
        {'worker-1': [0, 2], 'worker-2': [0, 1, 2, 3]}
        >>> select_resources(pool, num_nodes=1, num_gpus=2)
        {'worker-1': [0, 1]}
    """
    if include and exclude:
        raise LaunchError("--include and --exclude are mutually exclusive; keep one")
    found = bad_host(pool)
    if found is not None:
        raise LaunchError(f"{pool_name}: host {found[0]!r} is refused: {found[1]}")
    selected = {host: list(slots) for host, slots in pool.items()}
    if include or exclude:
        selected = _apply_filter(selected, include, exclude, pool_name)
        if not selected:
            raise LaunchError(f"--exclude {exclude!r} leaves no slot of {pool_name} to run on")
    if num_nodes > 0:
        if num_nodes > len(selected):
            raise LaunchError(
                f"--num_nodes {num_nodes}, but {pool_name} has {len(selected)} host(s): "
                f"{', '.join(selected)}"
            )
        selected = dict(list(selected.items())[:num_nodes])
    if num_gpus > 0:
        short = {host: len(slots) for host, slots in selected.items() if len(slots) < num_gpus}
        if short:
            have = ", ".join(f"{host} has {n}" for host, n in short.items())
            raise LaunchError(f"--num_gpus {num_gpus}, but in {pool_name} {have}")
        selected = {host: slots[:num_gpus] for host, slots in selected.items()}
    return selected
