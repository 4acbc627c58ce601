"""``OnDevice``: build a module's tensors directly on a device (e.g. ``"meta"``) and in a dtype."""

from __future__ import annotations

from types import TracebackType
from typing import Any

import torch

__all__ = ["OnDevice"]


class OnDevice:
    """Create modules' tensors on ``device`` and floating tensors in ``dtype`` (DeepSpeed's).

    Inside the context, factory calls that name no device (``torch.empty``, ``zeros``, ``randn``,
    ``nn.Linear``'s parameters, ...) allocate on ``device``, and floating tensors that name no
    dtype get ``dtype``. ``device="meta"`` builds a model without allocating its weights (load
    or materialise them later); ``device=f"cuda:{local_rank}"`` builds it straight on the GPU.
    Tensors that name a device or dtype explicitly keep it.

    Args:
        dtype: floating dtype of new floating tensors (None: keep torch's default).
        device: where new tensors go (default ``"meta"``).
        enabled: False makes the context do nothing.

    Example:
        >>> with OnDevice(dtype=torch.float16, device="meta"):
        ...     model = torch.nn.Linear(4096, 4096)
        >>> model.weight.device, model.weight.dtype
        (device(type='meta'), torch.float16)
    """

    def __init__(
        self, dtype: torch.dtype | None, device: str | torch.device = "meta", enabled: bool = True
    ) -> None:
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(
                f"OnDevice(dtype={dtype!r}): expected a floating torch dtype such as "
                "torch.float16, or None to keep the default"
            )
        self.dtype, self.device, self.enabled = dtype, torch.device(device), enabled
        self._saved: list[tuple[Any, torch.dtype]] = []

    def __enter__(self) -> OnDevice:
        if self.enabled:
            context = torch.device(self.device)
            context.__enter__()
            previous = torch.get_default_dtype()
            if self.dtype is not None:
                torch.set_default_dtype(self.dtype)
            self._saved.append((context, previous))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self.enabled:
            context, previous = self._saved.pop()
            torch.set_default_dtype(previous)
            context.__exit__(exc_type, exc, traceback)
