"""Peak memory per rank, the same way on every device: the allocator's peak where the
accelerator has one, live tensor bytes on CPU.

[Note: what the CPU peak counts]
A CPU has no caching allocator to ask for ``max_memory_allocated``, and the process's RSS mixes
tensors with the interpreter, libraries and freed-but-not-returned heap. :class:`LiveTensorBytes`
counts what ``torch.cuda.max_memory_allocated`` counts on a GPU: the bytes of tensor storages
alive at the same time, each storage once however many tensors view it. It is a
``TorchDispatchMode``: every aten operator that runs while it is active (forward, backward on
the autograd thread, the optimizer, collectives) reports its outputs, whose storages it records
with a ``weakref.finalize`` that takes their bytes off when the storage dies. Storages alive
before it started are found once by walking the garbage collector's tensors. Resizing a storage
in place (ZeRO-3 frees gathered parameters with ``untyped_storage().resize_(0)``) is not an
operator, so the live total is re-summed from the storages' current sizes each time a new
storage appears: the peak is taken at allocations, where it can rise. Not counted: memory that
is not a tensor storage (gloo's internal buffers, the Python heap), which a GPU's allocator
does not count either.
"""

from __future__ import annotations

import gc
import warnings
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveTensorBytes", "PeakMemory"]


class LiveTensorBytes(TorchDispatchMode):
    """Live and peak bytes of the tensor storages on one device type while the mode is active
    (see [Note: what the CPU peak counts]).

    Example:
        >>> with LiveTensorBytes() as live:
        ...     loss = model(batch); loss.backward()
        >>> live.peak, live.current
    """

    def __init__(self, device_type: str = "cpu") -> None:
        super().__init__()
        self.device_type = device_type
        self._storages: dict[int, weakref.ref[Any]] = {}
        self.current = 0
        self.peak = 0
        self.phase = "other"
        self.phase_peaks: dict[str, int] = {}
        self.window_peak = 0
        self._active = False

    def __enter__(self) -> LiveTensorBytes:
        with warnings.catch_warnings():  # isinstance() on deprecated torch aliases warns
            warnings.simplefilter("ignore")
            for obj in gc.get_objects():
                if isinstance(obj, torch.Tensor):
                    self._track(obj, resum=False)
        self.current = self._resum()
        self.peak = max(self.peak, self.current)
        self._active = True
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        """Stop counting; ``current`` and the peaks keep their last values."""
        self._active = False
        self._storages.clear()
        super().__exit__(*exc)

    def mark(self) -> int:
        """Start a window: :attr:`window_peak` restarts from the bytes alive now (returned)."""
        self.current = self._resum()
        self.window_peak = self.current
        return self.current

    def reset_peak(self) -> None:
        """Start a new peak from the bytes alive now."""
        self.current = self._resum()
        self.peak = self.current
        self.phase_peaks.clear()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf, resum=True)
        return out

    def _track(self, tensor: torch.Tensor, *, resum: bool) -> None:
        if tensor.device.type != self.device_type or tensor.is_meta:
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, or a subclass without storage
            return
        key = storage._cdata
        if key in self._storages:
            return
        self._storages[key] = weakref.ref(storage)
        # Not at interpreter exit: each call re-sums what is left, quadratic over a shutdown.
        weakref.finalize(storage, self._forget, key).atexit = False
        if resum:
            self.current = self._resum()
            self.peak = max(self.peak, self.current)
            self.window_peak = max(self.window_peak, self.current)
            if self.current > self.phase_peaks.get(self.phase, 0):
                self.phase_peaks[self.phase] = self.current

    def _forget(self, key: int) -> None:
        ref = self._storages.pop(key, None)
        if ref is not None and self._active:
            self.current = self._resum()

    def _resum(self) -> int:
        total = 0
        for ref in self._storages.values():
            storage = ref()
            if storage is not None:
                total += storage.nbytes()
        return total


class PeakMemory:
    """Peak bytes per rank on ``device``: the accelerator allocator's ``max_memory_allocated``
    on a GPU, :class:`LiveTensorBytes` on CPU. One interface so callers measure both alike.

    Example:
        >>> peak = PeakMemory(torch.device("cpu")); peak.start()
        >>> ...  # train
        >>> peak.stop(); peak.peak
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._live: LiveTensorBytes | None = None
        self._peak = 0
        self._phases: dict[str, int] = {}

    @property
    def counts(self) -> str:
        """What the number is: ``"allocator"`` or ``"live tensor bytes"``."""
        return "live tensor bytes" if self.device.type == "cpu" else "allocator"

    def start(self) -> None:
        """Begin measuring (the peak restarts from what is alive now)."""
        if self.device.type == "cpu":
            self._live = LiveTensorBytes("cpu").__enter__()
        else:
            from ds_comm.accelerator import get_accelerator

            self._peak = 0
            get_accelerator().reset_peak_memory_stats(self.device.index)

    @property
    def peak(self) -> int:
        """The peak so far (or at :meth:`stop`)."""
        if self._live is not None:
            return self._live.peak
        if self.device.type == "cpu":
            return self._peak
        from ds_comm.accelerator import get_accelerator

        # mark() resets the allocator's peak: the overall peak is the max of the windows.
        return max(self._peak, int(get_accelerator().max_memory_allocated(self.device.index)))

    def mark(self) -> int:
        """Start a window (see :meth:`window_peak`); returns the bytes alive now."""
        if self._live is not None:
            return self._live.mark()
        from ds_comm.accelerator import get_accelerator

        acc = get_accelerator()
        self._peak = max(self._peak, int(acc.max_memory_allocated(self.device.index)))
        acc.reset_peak_memory_stats(self.device.index)
        return int(acc.memory_allocated(self.device.index))

    def window_peak(self) -> int:
        """The peak since :meth:`mark`."""
        if self._live is not None:
            return self._live.window_peak
        from ds_comm.accelerator import get_accelerator

        return int(get_accelerator().max_memory_allocated(self.device.index))

    def set_phase(self, phase: str) -> None:
        """Name what runs now (``forward``, ``backward``, ``step``): the CPU tracker keeps a
        peak per phase, so a report can say where the peak was."""
        if self._live is not None:
            self._live.phase = phase

    @property
    def phase_peaks(self) -> dict[str, int]:
        """The peak per phase (CPU tracker only; empty on a GPU)."""
        return dict(self._live.phase_peaks) if self._live is not None else dict(self._phases)

    @property
    def current(self) -> int:
        """Bytes alive now."""
        if self._live is not None:
            return self._live.current
        from ds_comm.accelerator import get_accelerator

        return int(get_accelerator().memory_allocated(self.device.index))

    def stop(self) -> int:
        """Stop measuring; returns the peak."""
        if self._live is not None:
            self._peak = self._live.peak
            self._phases = dict(self._live.phase_peaks)
            self._live.__exit__(None, None, None)
            self._live = None
        return self.peak
