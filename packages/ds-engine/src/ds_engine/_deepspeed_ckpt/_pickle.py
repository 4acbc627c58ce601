"""Reading and writing DeepSpeed's pickled checkpoint files without DeepSpeed and without code.

[Note: DeepSpeed's pickled types]
DeepSpeed 0.16-0.19 checkpoint files are ``torch.save`` pickles of dicts, lists, tensors and
plain values, plus exactly four DeepSpeed globals:

- ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` and ``...DynamicLossScaler`` (the ZeRO
  optimizer's ``loss_scaler``; an object whose state is its ``__dict__``),
- ``deepspeed.runtime.zero.config.ZeroStageEnum`` (``zero_stage``; an ``IntEnum`` built from
  its value),
- ``deepspeed.utils.tensor_fragment.fragment_address`` (``param_slice_mappings``; a dataclass
  of ``numel`` and ``start``).

Reading uses ``torch.load(weights_only=True)`` with those four names mapped, for the duration
of the call only, onto the inert stand-ins below: torch's restricted unpickler then builds a
stand-in (``__new__`` and a ``__dict__`` update, or an enum lookup) and refuses every other
global, so a crafted file can never import or call anything. Nothing from DeepSpeed is
imported. Writing goes the other way: a pickler that emits DeepSpeed's global names for the
stand-ins, so real DeepSpeed unpickles its own classes from files ds wrote.
"""

from __future__ import annotations

import enum
import os
import pickle
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "DeepSpeedCheckpointError",
    "DynamicLossScalerState",
    "FragmentAddress",
    "LossScalerState",
    "ZeroStage",
    "load_file",
    "save_file",
]


class DeepSpeedCheckpointError(ValueError):
    """A DeepSpeed checkpoint that is missing a file, is inconsistent, or holds code."""


class LossScalerState:
    """Stand-in for ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` (static scale)."""

    def __init__(self, **state: Any) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


class DynamicLossScalerState(LossScalerState):
    """Stand-in for ``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler``."""


class ZeroStage(enum.IntEnum):
    """Stand-in for ``deepspeed.runtime.zero.config.ZeroStageEnum`` (same names, same values)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


class FragmentAddress:
    """Stand-in for ``deepspeed.utils.tensor_fragment.fragment_address``."""

    def __init__(self, numel: int, start: int) -> None:
        self.numel = numel
        self.start = start

    def __repr__(self) -> str:
        return f"FragmentAddress(numel={self.numel}, start={self.start})"


_GLOBALS: dict[type, str] = {
    LossScalerState: "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    DynamicLossScalerState: "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    ZeroStage: "deepspeed.runtime.zero.config.ZeroStageEnum",
    FragmentAddress: "deepspeed.utils.tensor_fragment.fragment_address",
}


@contextmanager
def _deepspeed_globals() -> Iterator[None]:
    with torch.serialization.safe_globals([(cls, name) for cls, name in _GLOBALS.items()]):
        yield


def load_file(path: str | os.PathLike[str]) -> Any:
    """One DeepSpeed checkpoint file, unpickled without running code (see [Note: DeepSpeed's
    pickled types]).

    Raises:
        DeepSpeedCheckpointError: the file is missing, or holds anything but data (the message
            names the file and the refused global).
    """
    file = Path(path)
    if not file.is_file():
        raise DeepSpeedCheckpointError(f"DeepSpeed checkpoint file {str(file)!r} is missing")
    try:
        with _deepspeed_globals():
            return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DeepSpeedCheckpointError(
            f"refusing to load {str(file)!r}: it holds something other than tensors, plain "
            f"values and DeepSpeed's four data types, and loading never runs code ({first})"
        ) from None
    except Exception as exc:  # truncated or corrupt: torch raises many types
        raise DeepSpeedCheckpointError(
            f"cannot read DeepSpeed checkpoint file {str(file)!r}: {exc}"
        ) from None


class _DeepSpeedPickler(pickle._Pickler):  # type: ignore[name-defined]
    """Writes the stand-ins under DeepSpeed's global names (pure-Python pickler: its
    ``save_global`` can be overridden; tensors still go through torch's persistent ids)."""

    def save_global(self, obj: Any, name: str | None = None) -> None:
        target = _GLOBALS.get(obj) if isinstance(obj, type) else None
        if target is None:
            super().save_global(obj, name)  # pyright: ignore[reportAttributeAccessIssue]  (untyped pure-Python _Pickler)
            return
        module, _, qualname = target.rpartition(".")
        self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())  # pyright: ignore[reportAttributeAccessIssue]
        self.memoize(obj)  # pyright: ignore[reportAttributeAccessIssue]  (as above)

    dispatch = dict(pickle._Pickler.dispatch)  # type: ignore[attr-defined]
    dispatch[type] = save_global  # pyright: ignore[reportArgumentType]  (typeshed types the table loosely)


_PICKLE_MODULE = types.SimpleNamespace(
    __name__="pickle", Pickler=_DeepSpeedPickler, Unpickler=pickle.Unpickler
)


def save_file(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save`` ``obj`` to ``path`` (fsynced) as DeepSpeed would have pickled it."""
    with open(path, "wb") as f:
        torch.save(obj, f, pickle_module=_PICKLE_MODULE, pickle_protocol=2)
        f.flush()
        os.fsync(f.fileno())
