"""Public types of ds-offload-aio: the ``aio`` config section, errors, warnings, backend report."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal, TypedDict

from ds_comm import ConfigError
from ds_comm.api import as_section, check_keys

__all__ = [
    "ALIGNMENT",
    "AioConfig",
    "AioError",
    "AioFallbackWarning",
    "Backend",
    "BackendInfo",
    "ConfigError",
    "GdsUnavailableError",
]

ALIGNMENT = 4096
"""O_DIRECT alignment used for file offsets, lengths and memory (safe for 512 B and 4 KiB disks)."""

Backend = Literal["libaio", "threads"]
"""How a handle moves bytes: kernel AIO through the C engine, or a pool of ``os.preadv`` threads."""


class BackendInfo(TypedDict):
    """What ``ds_offload_aio.backend_info()`` reports."""

    backend: Backend
    """The backend a handle created with ``backend="auto"`` uses."""
    reason: str | None
    """Why libaio is unavailable (None when it is the backend)."""


class AioError(OSError):
    """A read or write failed. ``errno``, ``filename`` and ``offset`` say what, where and why.

    ``errno`` is None for a short transfer (end of file reached, or a write the device cut short).
    """

    def __init__(
        self, code: int | None, message: str, filename: str, *, offset: int, op: str
    ) -> None:
        super().__init__(code, message, filename)
        self.offset = offset
        self.op = op

    def __str__(self) -> str:
        code = f" [Errno {self.errno}]" if self.errno is not None else ""
        return (
            f"{self.op} of {self.filename!r} at offset {self.offset} failed: {self.strerror}{code}"
        )


class AioFallbackWarning(RuntimeWarning):
    """Warned once when libaio or O_DIRECT is unavailable and a slower path is used instead."""


class GdsUnavailableError(RuntimeError):
    """``GdsHandle`` was created but neither kvikio nor cuFile can be imported."""


def _check_positive_int(section: str, name: str, value: object, multiple_of: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{section}.{name} = {value!r}: expected a positive integer")
    if value % multiple_of:
        raise ConfigError(
            f"{section}.{name} = {value!r}: must be a multiple of {multiple_of} (O_DIRECT "
            f"alignment); try {max(multiple_of, value // multiple_of * multiple_of)}"
        )


def _check_bool(section: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(
            f"{section}.{name} = {value!r}: expected true or false (got {type(value).__name__})"
        )


def _check_handle_settings(section: str, **settings: Any) -> None:
    """Validates the five handle settings; errors name ``section.key``, the value and the fix."""
    _check_positive_int(section, "block_size", settings["block_size"], ALIGNMENT)
    _check_positive_int(section, "queue_depth", settings["queue_depth"])
    _check_positive_int(section, "intra_op_parallelism", settings["intra_op_parallelism"])
    _check_bool(section, "single_submit", settings["single_submit"])
    _check_bool(section, "overlap_events", settings["overlap_events"])


@dataclass(frozen=True, kw_only=True)
class AioConfig:
    """The ``aio`` config section (DeepSpeed's key names and defaults).

    Attributes:
        block_size: bytes per I/O request (a multiple of 4096).
        queue_depth: requests in flight per worker thread.
        intra_op_parallelism: worker threads one read or write is split across, each with its
            own io context (DeepSpeed's older name ``thread_count`` is accepted by
            ``from_dict``).
        single_submit: submit requests one ``io_submit`` call at a time instead of in batches.
        overlap_events: refill the queue as requests complete instead of batch by batch.
        use_gds: move CUDA tensors with GPUDirect Storage (``GdsHandle``; needs kvikio).
    """

    block_size: int = 1048576
    queue_depth: int = 8
    intra_op_parallelism: int = 1
    single_submit: bool = False
    overlap_events: bool = True
    use_gds: bool = False

    def __post_init__(self) -> None:
        settings = asdict(self)
        _check_bool("aio", "use_gds", settings.pop("use_gds"))
        _check_handle_settings("aio", **settings)

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | None) -> AioConfig:
        """Builds from the JSON ``aio`` section; unknown keys are errors with a suggestion."""
        section = as_section("aio", section)
        if "thread_count" in section:
            legacy = section.pop("thread_count")
            current = section.setdefault("intra_op_parallelism", legacy)
            if current != legacy:
                raise ConfigError(
                    f"aio.thread_count = {legacy!r} contradicts aio.intra_op_parallelism = "
                    f"{current!r}: thread_count is the old name, keep only intra_op_parallelism"
                )
        check_keys("aio", section, (f.name for f in fields(cls)))
        return cls(**section)

    def handle_kwargs(self) -> dict[str, Any]:
        """The ``AioHandle`` constructor arguments this section describes."""
        settings = asdict(self)
        del settings["use_gds"]
        return settings
