"""Stage 3 module hooks: gather each module's parameters around its forward and backward,
release them after, and prefetch the next modules' parameters along a recorded trace.

[Note: which parameters a module fetches]
A module's *fetch set* is its direct parameters (``recurse=False``), the parameters registered
on it as external (``module._ds_external_params``, appended by ``register_external_parameter``)
and, for a module with direct parameters of its own (a compute module, not a container), the
parameters of children whose own forward never runs: ``nn.MultiheadAttention`` reads
``out_proj.weight`` without calling ``out_proj``. Which children run is only known after one
forward, so during the first forward such a module also fetches every immediate child's direct
parameters (one module level of extra working set, once); at the end of the first forward it
keeps only the children that did not run. Containers (no direct parameters) never fetch for
their children, so a branch that is not taken costs nothing. A module that reads the
parameters of a child that *does* run (a tied head applied in the root's forward after the
embedding's forward released the weight), or a container that reads a child's parameters
directly, gets them through [Note: parameters read outside their module]. A parameter is only
released when no module whose forward is running fetched it (``p.ds_active_sub_modules``,
DeepSpeed's name), so a child's forward does not take away what an enclosing module still
reads.

[Note: parameters read outside their module]
While the hooks are installed, every module's ``_parameters`` is a :class:`_ZeroParams`: a dict
whose item lookup (what ``module.weight`` runs) gathers a partitioned parameter that is not
gathered when some module's forward is running, and registers it as an external parameter of
the innermost running module (DeepSpeed's ``ZeROOrderedDict`` and forward module stack). From
then on it is part of that module's fetch set: gathered at its forward (and, through the
module's ``_PreBackward``, before its backward), released after its forward like its own
parameters, and by the optimizer's gradient hook after backward, which fires once the
gradients of every use (the head's and the embedding's) have been summed. Lookups outside a
forward, and iteration (``parameters()``, ``state_dict()``), never gather. The running modules
are a process-wide stack (``_RUNNING``) because the lookup has only the dict to go on; each entry
names the hooks that pushed it.

[Note: gathering for backward]
Autograd saves the parameter objects (or views of them) for backward, so releasing a parameter
(``p.data`` becomes empty and its whole storage is freed, see ``_partitioned.py``'s [Note:
freeing gathered storage]) and gathering it again into the same storage before its backward
node runs is enough. Each module's
forward outputs pass through ``_PreBackward``, an identity whose backward gathers the module's
fetch set: it runs when the outputs' gradients are ready, before any of the module's own
backward nodes. A parameter is released again by the optimizer's gradient hook, which fires once
all of its uses in the graph have accumulated their gradient (once per backward even when tied
into several modules).

[Note: trace and prefetch]
Every forward pre-hook and every ``_PreBackward`` is an event. The events of the first
forward+backward are the trace. In later iterations event ``i`` must be ``trace[i]``: the module
fetched at ``i`` is expected, and the fetch sets of ``trace[i + 1], ...`` that are not gathered
yet are gathered asynchronously in one coalesced collective, up to ``stage3_prefetch_bucket_size``
elements and as long as the gathered elements stay under ``stage3_max_live_parameters``. An
event that is not ``trace[i]`` (a data-dependent branch) invalidates the plan: parameters
prefetched and not yet used are released and the current iteration's events become the new
trace. After a module's forward a parameter is kept (not released) when the trace says it is
used again within ``stage3_max_reuse_distance`` elements of other fetched parameters. All ranks
see the same events, so they issue the same collectives in the same order.

[Note: leaf modules]
A module flagged as a ZeRO-3 leaf (``module._z3_leaf``, set by ``set_z3_leaf_modules``) is
fetched as one unit: its fetch set is every parameter below it, gathered in one collective at
its forward (and at its backward), and the hooks of the modules inside it do nothing while it
runs. A mixture-of-experts block whose experts run in a data-dependent order is the use: its
event sequence is one event whatever the routing, so the trace stays valid, and experts that
receive no token still have their parameters gathered, so every rank issues the same
collectives. The flag is read at each forward, so it may be set before or after the optimizer
is built.
"""

# DeepSpeed's ZeRO-3 parameter attributes (p.ds_id, p.ds_tensor, p.ds_status, ...) are set on
# torch Parameters at run time, which the type checker cannot see.
# pyright: reportAttributeAccessIssue=false

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch.utils.hooks import RemovableHandle

from ds_zero._init import register_external_parameter
from ds_zero._partitioned import GatherHandle, ParamPartitioner, ZeroParamStatus

__all__ = ["PrefetchStats", "Stage3Hooks"]

Phase = Literal["forward", "backward"]


@dataclass
class PrefetchStats:
    """Counters proving what prefetch did.

    Attributes:
        hits: fetches whose parameters were all gathered (or in flight) by a prefetch.
        misses: fetches (with a complete trace) that had to gather synchronously.
        invalidations: times the observed module order left the trace.
        prefetched: parameters gathered ahead of use.
    """

    hits: int = 0
    misses: int = 0
    invalidations: int = 0
    prefetched: int = 0


# (hooks, module) for every module whose forward is running, innermost last; see [Note:
# parameters read outside their module].
_RUNNING: list[tuple[Stage3Hooks, torch.nn.Module]] = []


class _ZeroParams(dict):  # type: ignore[type-arg]
    """A module's ``_parameters`` under stage 3 hooks (see [Note: parameters read outside
    their module]). Copies and pickles are plain dicts."""

    __slots__ = ()

    def __getitem__(self, key: str) -> Any:
        p = dict.__getitem__(self, key)
        if (
            _RUNNING
            and p is not None
            and getattr(p, "ds_status", ZeroParamStatus.AVAILABLE) is not ZeroParamStatus.AVAILABLE
            and not torch.compiler.is_compiling()
        ):
            hooks, module = _RUNNING[-1]
            hooks.gather_read(module, p)
        return p

    def __reduce__(self) -> Any:
        return (dict, (dict(self),))


class _PreBackward(torch.autograd.Function):
    """Identity on a module's outputs; its backward gathers the module's parameters first (see
    [Note: gathering for backward])."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *tensors: torch.Tensor) -> Any:
        ctx.callback = callback
        ctx.set_materialize_grads(False)
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        ctx.callback()
        return (None, *grads)


def is_leaf(module: torch.nn.Module) -> bool:
    """Whether ``module`` is flagged as a ZeRO-3 leaf (see [Note: leaf modules])."""
    return bool(getattr(module, "_z3_leaf", False))


def _map_tensors(obj: Any, fn: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> Any:
    """Apply ``fn`` once to every tensor requiring grad inside ``obj`` (tuples, lists, dicts,
    dataclass instances: ds-moe's gate returns a ``Routing``).

    The walks are module-level functions, not nested closures: a closure that calls itself is a
    reference cycle, and one holding the module's outputs would keep every activation alive
    until the garbage collector runs, long after backward freed them.
    """
    found: list[torch.Tensor] = []
    _collect(obj, found)
    if not found:
        return obj
    return _rebuild(obj, iter(fn(found)))


def _collect(o: Any, found: list[torch.Tensor]) -> None:
    if torch.is_tensor(o):
        if o.requires_grad:
            found.append(o)
    elif isinstance(o, (tuple, list)):
        for x in o:
            _collect(x, found)
    elif isinstance(o, dict):
        for x in o.values():
            _collect(x, found)
    elif dataclasses.is_dataclass(o) and not isinstance(o, type):
        for f in dataclasses.fields(o):
            if f.init:
                _collect(getattr(o, f.name), found)


def _rebuild(o: Any, replaced: Iterator[torch.Tensor]) -> Any:
    if torch.is_tensor(o):
        return next(replaced) if o.requires_grad else o
    if isinstance(o, tuple) and hasattr(o, "_fields"):  # named tuples
        return type(o)(*(_rebuild(x, replaced) for x in o))
    if isinstance(o, (tuple, list)):
        return type(o)(_rebuild(x, replaced) for x in o)
    if isinstance(o, dict):
        return type(o)((k, _rebuild(v, replaced)) for k, v in o.items())
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        fields = [f.name for f in dataclasses.fields(o) if f.init]
        return dataclasses.replace(o, **{n: _rebuild(getattr(o, n), replaced) for n in fields})
    return o


class Stage3Hooks:
    """Installs the stage 3 hooks on every module of ``model`` that holds parameters (see
    [Note: which parameters a module fetches], [Note: trace and prefetch]).

    Args:
        model: the root module (its parameters already partitioned).
        partitioner: gathers and releases them.
        prefetch_bucket_size: elements gathered ahead of use (0: no prefetch).
        max_live_parameters: most gathered elements prefetch may leave live.
        max_reuse_distance: keep a parameter gathered after a forward when it is used again
            within this many elements (0: always release).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        partitioner: ParamPartitioner,
        *,
        prefetch_bucket_size: int,
        max_live_parameters: int,
        max_reuse_distance: int,
    ) -> None:
        self.model, self.partitioner = model, partitioner
        self.prefetch_bucket_size = prefetch_bucket_size
        self.max_live_parameters = max_live_parameters
        self.max_reuse_distance = max_reuse_distance
        self.stats = PrefetchStats()
        self._handles: list[RemovableHandle] = []
        self._modules = [m for m in model.modules() if any(True for _ in m.parameters())]
        if model not in self._modules:
            self._modules.insert(0, model)
        self._borrowed: dict[int, list[torch.nn.Parameter]] | None = None  # None: first forward
        # (module id, external parameter ids...) -> fetch set, once borrowing is learned
        self._fetch_sets: dict[tuple[int, ...], list[torch.nn.Parameter]] = {}
        self._ran: set[int] = set()
        self.trace: list[torch.nn.Module] | None = None
        self._events: list[torch.nn.Module] = []  # this iteration's
        self._phases: list[Phase] = []  # forward or backward, by event (for ZeRO++'s hpZ)
        self._trace_phases: list[Phase] = []
        self._pos = 0
        self._prefetched: dict[int, torch.nn.Parameter] = {}  # ds_id -> not yet used
        self._keep: dict[int, set[int]] = {}  # trace index -> ds_ids to keep after its forward
        self._open: list[int] = []  # event index of each module whose forward is running
        self._leaf: list[torch.nn.Module] = []  # the leaf module whose forward is running
        # Under torch.compile the hooks run eagerly (a graph break around each): they gather and
        # release storage and keep Python state that dynamo cannot trace (docs/compile.md).
        pre = cast(Callable[..., Any], torch._dynamo.disable(self._forward_pre))
        post = cast(Callable[..., Any], torch._dynamo.disable(self._forward_post))
        for m in self._modules:
            self._handles.append(m.register_forward_pre_hook(pre))
            self._handles.append(m.register_forward_hook(post))
        for m in model.modules():
            params = m.__dict__.get("_parameters")
            if isinstance(params, dict) and not isinstance(params, _ZeroParams):
                m.__dict__["_parameters"] = _ZeroParams(params)

    def remove(self) -> None:
        """Remove every hook (and give every module a plain ``_parameters`` dict back)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for m in self.model.modules():
            params = m.__dict__.get("_parameters")
            if isinstance(params, _ZeroParams):
                m.__dict__["_parameters"] = dict(params)
        _RUNNING[:] = [entry for entry in _RUNNING if entry[0] is not self]

    def gather_read(self, module: torch.nn.Module, p: torch.nn.Parameter) -> None:
        """Gather ``p``, read by ``module``'s running forward although ``module`` does not
        fetch it, and make it one of ``module``'s external parameters (see [Note: parameters
        read outside their module])."""
        if not self.partitioner.owns(p):
            return  # not this model's: only its own partitioner's hooks can gather it
        register_external_parameter(module, p)
        p.ds_active_sub_modules.add(id(module))
        self.partitioner.gather([p], phase="forward")

    # --- fetch sets ------------------------------------------------------------------------------

    def fetch_set(self, module: torch.nn.Module) -> list[torch.nn.Parameter]:
        """The parameters ``module`` needs whole while it runs (see [Note: which parameters a
        module fetches])."""
        external = getattr(module, "_ds_external_params", ())
        leaf = is_leaf(module)
        key = (id(module), leaf, *map(id, external))
        cached = self._fetch_sets.get(key) if self._borrowed is not None else None
        if cached is not None:
            return cached
        params = list(module.parameters(recurse=leaf))
        own = bool(params) and not leaf
        params += list(external)
        if leaf:
            for sub in module.modules():
                params += list(getattr(sub, "_ds_external_params", ()))
        if own and self._borrowed is None:
            for child in module.children():
                params += list(child.parameters(recurse=False))
        elif own:
            assert self._borrowed is not None  # the branch above took the None case
            params += self._borrowed.get(id(module), [])
        seen: set[int] = set()
        out = []
        for p in params:
            if id(p) not in seen and hasattr(p, "ds_id"):
                seen.add(id(p))
                out.append(p)
        if self._borrowed is not None:
            self._fetch_sets[key] = out
        return out

    def _learn_borrowed(self) -> None:
        borrowed: dict[int, list[torch.nn.Parameter]] = {}
        for m in self._modules:
            if not any(True for _ in m.parameters(recurse=False)):
                continue
            for child in m.children():
                if id(child) not in self._ran:
                    borrowed.setdefault(id(m), []).extend(child.parameters())
        self._borrowed = borrowed

    # --- hooks -----------------------------------------------------------------------------------

    def _forward_pre(self, module: torch.nn.Module, args: Any) -> None:
        if self._leaf:  # inside a leaf module: it fetched everything (see [Note: leaf modules])
            return
        if is_leaf(module):
            self._leaf.append(module)
        self._ran.add(id(module))
        record = torch.is_grad_enabled()
        if record:
            self._open.append(len(self._events))
        self._fetch(module, record=record)
        for p in self.fetch_set(module):  # not released while a running module uses it
            p.ds_active_sub_modules.add(id(module))
        _RUNNING.append((self, module))

    def _forward_post(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        if self._leaf:
            if self._leaf[-1] is not module:
                return output
            self._leaf.pop()
        if _RUNNING and _RUNNING[-1][1] is module:
            _RUNNING.pop()
        record = torch.is_grad_enabled()
        if module is self.model and self._borrowed is None:
            self._learn_borrowed()
        index = self._open.pop() if record and self._open else -1
        keep = self._keep.get(index, set()) if self._following() else set()
        params = self.fetch_set(module)
        for p in params:
            p.ds_active_sub_modules.discard(id(module))
        self.partitioner.release(
            [
                p
                for p in params
                if not p.ds_active_sub_modules
                and p.ds_id not in keep
                and p.ds_id not in self._prefetched
            ],
            free_storage=True,
        )
        if not record:
            return output

        def callback() -> None:
            self._fetch(module, record=True, backward=True)

        return _map_tensors(output, lambda ts: list(_PreBackward.apply(callback, *ts)))

    def _fetch(self, module: torch.nn.Module, *, record: bool, backward: bool = False) -> None:
        params = self.fetch_set(module)
        phase: Phase = "backward" if backward else "forward"  # for ZeRO++ (_zeropp.py)
        if not record:
            self.partitioner.gather(params, phase=phase)
            return
        self._events.append(module)
        self._phases.append(phase)
        waiting = [p for p in params if not p.ds_persist]
        prefetched = [self._prefetched.pop(p.ds_id, None) is not None for p in waiting]
        following = self._following()
        if following:
            assert self.trace is not None
            if self._pos < len(self.trace) and self.trace[self._pos] is module:
                self._pos += 1
            else:
                self._invalidate()  # keeps this module's prefetched parameters: popped above
                following = False
        if following and waiting:
            if any(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in waiting):
                self.stats.misses += 1
            elif any(prefetched):
                self.stats.hits += 1
        handle = self.partitioner.gather(params, async_op=True, phase=phase)
        if following:
            self._prefetch()
        handle.wait()

    # --- trace -----------------------------------------------------------------------------------

    def _following(self) -> bool:
        return self.trace is not None

    def _invalidate(self) -> None:
        self.stats.invalidations += 1
        self.trace = None
        self._keep = {}
        self.partitioner.release(list(self._prefetched.values()), free_storage=True)
        self._prefetched.clear()

    def end_iteration(self) -> None:
        """Close one forward+backward: the first (or an invalidated) iteration becomes the trace;
        any parameter of the model still gathered and not persistent is released."""
        self._leaf.clear()  # a forward that raised inside a leaf module left it open
        _RUNNING[:] = [entry for entry in _RUNNING if entry[0] is not self]
        if self.trace is None or len(self._events) != len(self.trace):
            if self.trace is not None:
                self._invalidate()
            if self._events:
                self.trace = list(self._events)
                self._trace_phases = list(self._phases)
                self._plan_reuse()
        self._events = []
        self._phases = []
        self._open = []
        self._pos = 0
        self._prefetched.clear()
        params = [p for p in self.model.parameters() if hasattr(p, "ds_id")]
        for p in params:
            p.ds_active_sub_modules.clear()  # a forward that raised leaves its modules open
        self.partitioner.release(params, free_storage=True)

    def _plan_reuse(self) -> None:
        """For each trace index, the parameters to keep after its forward (see [Note: trace and
        prefetch])."""
        assert self.trace is not None
        self._keep = {}
        if self.max_reuse_distance == 0:
            return
        sets = [[p for p in self.fetch_set(m) if not p.ds_persist] for m in self.trace]
        # elements fetched before event i, counting each event's parameters once
        before = [0]
        for params in sets:
            before.append(before[-1] + sum(p.ds_numel for p in params))
        next_use: dict[int, int] = {}
        for i in range(len(sets) - 1, -1, -1):
            keep = set()
            for p in sets[i]:
                j = next_use.get(p.ds_id)
                if j is not None and before[j] - before[i + 1] <= self.max_reuse_distance:
                    keep.add(p.ds_id)
            if keep:
                self._keep[i] = keep
            for p in sets[i]:
                next_use[p.ds_id] = i

    def _prefetch(self) -> GatherHandle | None:
        if self.prefetch_bucket_size <= 0:
            return None
        assert self.trace is not None
        budget = self.prefetch_bucket_size
        live_room = self.max_live_parameters - self.partitioner.live_numel()
        chosen: list[tuple[torch.nn.Parameter, Phase]] = []
        seen: set[int] = set()
        total = 0
        upcoming = zip(self.trace[self._pos :], self._trace_phases[self._pos :])
        for module, phase in upcoming:
            for p in self.fetch_set(module):
                if p.ds_persist or id(p) in seen:
                    continue
                seen.add(id(p))
                if p.ds_status is not ZeroParamStatus.NOT_AVAILABLE:
                    # Gathered or in flight already (an earlier prefetch): it fills the window
                    # too, else the window would grow by a bucket at every module.
                    total += p.ds_numel
                    if total > budget:
                        return self._issue(chosen)
                    continue
                if total + p.ds_numel > min(budget, live_room):
                    return self._issue(chosen)
                chosen.append((p, phase))
                total += p.ds_numel
        return self._issue(chosen)

    def _issue(self, chosen: list[tuple[torch.nn.Parameter, Phase]]) -> GatherHandle | None:
        """Gather ``chosen`` ahead of use; under ZeRO++ one collective for the parameters of
        upcoming forward events and one for those of backward events (which hpZ gathers within
        its group)."""
        if self.partitioner.weight_comm is None:  # no ZeRO++: one collective
            return self._issue_one([p for p, _ in chosen], "forward") if chosen else None
        handle = None
        for phase in ("forward", "backward"):
            params = [p for p, used in chosen if used == phase]
            if params:
                handle = self._issue_one(params, phase)
        return handle

    def _issue_one(self, params: list[torch.nn.Parameter], phase: Phase) -> GatherHandle:
        for p in params:
            self._prefetched[p.ds_id] = p
        self.stats.prefetched += len(params)
        return self.partitioner.gather(params, async_op=True, phase=phase)
