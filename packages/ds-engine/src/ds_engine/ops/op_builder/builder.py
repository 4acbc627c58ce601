"""``deepspeed.ops.op_builder.builder``: ``OpBuilder``, DeepSpeed's op-builder interface over ds's
prebuilt kernels.

[Note: op builders without a JIT]
DeepSpeed's builders compile C++/CUDA sources on first ``load()`` (or at install time with
``DS_BUILD_OPS=1``), and that build is its users' largest source of trouble. ds's kernels are
built when their wheels install (ds-native's C through cffi, ds-offload-aio's libaio engine) or
are Triton/torch code (ds-kernels, ds-optim); nothing compiles at run time. So a builder here
only names the ds module that provides the op: ``load()`` imports and returns it,
``is_compatible()`` says whether it can run on this machine, and ``jit_load()`` is ``load()``.
The module returned is ds's API (``ds_native.adam_step``, ``ds_offload_aio.aio_handle``), not
the C++ extension ABI of DeepSpeed's (``create_adam``/``adam_update``): code that only calls
``load()`` to check an op or hand it to a ds optimizer works; code that drives DeepSpeed's
extension functions directly does not.

A builder for an op ds does not implement (fused transformer kernels, inference kernels,
quantizers, ...) reports ``is_compatible() == False`` and its ``load()`` raises
``NotImplementedError`` naming the op.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["OpBuilder", "NotImplementedBuilder"]


class OpBuilder:
    """An op ds provides from a prebuilt module (see [Note: op builders without a JIT]).

    Subclasses set ``NAME`` (DeepSpeed's op name), ``MODULE`` (the ds module ``load()``
    returns) and ``FEATURE`` (what the op is, for messages), and may override
    :meth:`_incompatible_reason`.

    Example:
        >>> CPUAdamBuilder().load().adam_step  # ds-native's CPU Adam kernel
    """

    NAME = "op"
    MODULE = ""
    FEATURE = ""

    def __init__(self, name: str | None = None) -> None:
        self.name = self.NAME if name is None else name

    def absolute_name(self) -> str:
        """The module ``load()`` returns."""
        return self.MODULE

    def _incompatible_reason(self) -> str | None:
        """Why the op cannot run here (None: it can)."""
        try:
            importlib.import_module(self.MODULE)
        except ImportError as exc:
            return f"{self.MODULE} does not import: {exc}"
        return None

    def is_compatible(self, verbose: bool = False) -> bool:
        """Whether ``load()`` gives a module that runs here; ``verbose`` prints why not."""
        reason = self._incompatible_reason()
        if reason is not None and verbose:
            print(f"{self.name}: {reason}")
        return reason is None

    def load(self, verbose: bool = True) -> ModuleType:
        """The ds module that provides the op (prebuilt: nothing compiles).

        Raises:
            RuntimeError: the op cannot run here (the message says why).
        """
        reason = self._incompatible_reason()
        if reason is not None:
            raise RuntimeError(f"op {self.name!r} ({self.FEATURE}) is unavailable: {reason}")
        return importlib.import_module(self.MODULE)

    def jit_load(self, verbose: bool = True) -> ModuleType:
        """``load()``: ds compiles nothing at run time."""
        return self.load(verbose)

    def builder(self) -> None:
        """Refused: ds builds its kernels when its wheels install, not through setuptools
        extensions made here."""
        raise NotImplementedError(
            f"{type(self).__name__}.builder(): ds builds no extension at run time; its kernels "
            f"are built when their packages install (load() returns {self.MODULE})"
        )


class NotImplementedBuilder(OpBuilder):
    """The builder of an op ds does not implement: incompatible, ``load()`` refuses."""

    def _incompatible_reason(self) -> str | None:
        return f"{self.FEATURE} is not implemented in ds"

    def load(self, verbose: bool = True) -> ModuleType:
        raise NotImplementedError(
            f"op {self.name!r} ({self.FEATURE}) is not implemented in ds: "
            f"{type(self).__name__}().load() has no kernel to return"
        )
