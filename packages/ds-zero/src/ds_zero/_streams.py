"""``SideStream`` and ``CollectiveQueue``: the one place that issues ZeRO's gradient collectives
on a side stream, keeps them in flight and lands their results: every stage's reducer
(the flat buckets of stages 0-2 in ``_reduce.py`` and the per-parameter shards of stage 3 in
``_shard_reduce.py``) and stage 3's parameter all-gathers go through it.

[Note: side streams for overlap]
With ``overlap_comm`` on an accelerator with streams (CUDA), a collective and the copies around
it are queued on a dedicated side stream obtained from the accelerator
(``get_accelerator().Stream``), so that they run while the compute stream carries on with
backward. Before work is queued there, the side stream waits for the compute stream (the
gradient it reads was produced there); a tensor allocated on one stream and used on the other is
marked with ``record_stream`` so that the caching allocator does not hand its memory out while
the other stream still uses it; and before the compute stream reads a result (the end of
backward, a gathered parameter), it waits for the side stream. On the CPU accelerator the
stream is the host's no-op stream and tensors are not marked, so the CPU path is the same
sequence of operations as without a stream: the numerics are identical; gloo's asynchronous
work handles are the overlap there. (Written against the Stream/Event API; not yet verified on
a GPU.)
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ds_comm.accelerator import get_accelerator

__all__ = ["CollectiveQueue", "SideStream"]


class SideStream:
    """A side stream of ``device``'s accelerator for overlapped collectives (see [Note: side
    streams for overlap]), or nothing when there is none to use.

    Args:
        device: where the tensors live.
        enabled: ``overlap_comm``; False gives no stream (work stays on the current stream).
    """

    def __init__(self, device: torch.device, enabled: bool) -> None:
        accelerator = get_accelerator()
        self.device = device
        # on the CPU accelerator this is its no-op host stream: the same calls, no effect
        usable = enabled and device.type == accelerator.device_name()
        self._accelerator = accelerator if usable else None
        self.stream: Any = accelerator.Stream(device=device) if usable else None

    @property
    def active(self) -> bool:
        """Whether work is queued on a stream of its own."""
        return self.stream is not None

    @contextlib.contextmanager
    def use(self) -> Iterator[None]:
        """Queue the block's work on the side stream, after what the compute stream queued."""
        if self._accelerator is None:
            yield
            return
        self.stream.wait_stream(self._accelerator.current_stream(self.device.index))
        with self._accelerator.stream(self.stream):
            yield

    def record(self, tensor: torch.Tensor) -> None:
        """Mark ``tensor`` (allocated on the compute stream) as used by the side stream."""
        if self.stream is not None and tensor.device.type != "cpu":
            tensor.record_stream(self.stream)

    def join(self) -> None:
        """Make the compute stream wait for everything queued on the side stream."""
        if self._accelerator is not None:
            self._accelerator.current_stream(self.device.index).wait_stream(self.stream)


@dataclass
class _InFlight:
    """A launched collective and what to do once it completes."""

    work: Any
    finalize: Callable[[], None] | None
    release: Callable[[], None] | None


class CollectiveQueue:
    """Gradient collectives in flight, issued on a :class:`SideStream` and landed in order.

    Args:
        device: where the gradients live.
        overlap: ``overlap_comm``: collectives are asynchronous and waited for later; otherwise
            each is waited for as soon as it is issued.
        world_size: ranks the gradients are averaged over (the data-parallel group).
        predivide_factor: divide before the sum by this and multiply the sum by
            ``factor / world_size`` after it (None: the world size, all of it before).
        comm_dtype: dtype the collectives run in (None: the gradients').
    """

    def __init__(
        self,
        device: torch.device,
        *,
        overlap: bool,
        world_size: int,
        predivide_factor: float | None = None,
        comm_dtype: torch.dtype | None = None,
    ) -> None:
        self.side = SideStream(device, overlap)
        self.overlap = overlap
        self.predivide = 1.0 if world_size == 1 else float(predivide_factor or world_size)
        self.postscale = 1.0 if world_size == 1 else self.predivide / world_size
        self.comm_dtype = comm_dtype
        self._inflight: deque[_InFlight] = deque()

    def __len__(self) -> int:
        return len(self._inflight)

    def send_buffer(self, buffer: torch.Tensor) -> torch.Tensor:
        """``buffer`` divided by the predivide factor (in place), cast to the communication
        dtype when it differs (call inside :meth:`SideStream.use`)."""
        if self.predivide != 1.0:
            buffer.div_(self.predivide)
        if self.comm_dtype is None or self.comm_dtype == buffer.dtype:
            return buffer
        return buffer.to(self.comm_dtype)

    def scale(self, reduced: torch.Tensor) -> Callable[[], object] | None:
        """The post-division of a reduced sum (None when there is none)."""
        if self.postscale == 1.0:
            return None
        return lambda: reduced.mul_(self.postscale)

    def push(
        self,
        work: Any,
        finalize: Callable[[], None] | None = None,
        release: Callable[[], None] | None = None,
        *,
        max_in_flight: int | None = None,
    ) -> None:
        """Keep ``work`` in flight; without overlap (or beyond ``max_in_flight``) land the
        oldest now."""
        self._inflight.append(_InFlight(work, finalize, release))
        limit = 0 if not self.overlap else max_in_flight
        while limit is not None and len(self._inflight) > limit:
            self.wait_oldest()

    def wait_oldest(self) -> None:
        """Wait for the oldest collective and land its result (on the side stream)."""
        item = self._inflight.popleft()
        with self.side.use():
            if item.work is not None:
                item.work.wait()
            if item.finalize is not None:
                item.finalize()
            if item.release is not None:
                item.release()

    def wait_all(self) -> None:
        """Land every collective; the compute stream then waits for the side stream."""
        while self._inflight:
            self.wait_oldest()
        self.side.join()

    def drop(self) -> None:
        """Wait for every collective without landing results (backward raised)."""
        while self._inflight:
            item = self._inflight.popleft()
            if item.work is not None:
                with contextlib.suppress(Exception):
                    item.work.wait()
            if item.release is not None:
                item.release()
        self.side.join()
