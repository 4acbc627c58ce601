"""``deepspeed.utils.logging``: the ``"DeepSpeed"`` logger and rank-filtered logging helpers.

The logger writes to stdout at WARNING and above with DeepSpeed's format and does not propagate
to the root logger, so the clients that tune it (transformers sets its level, Lightning calls
``deepspeed.utils.logging.logger.setLevel``) see the logger they expect.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
from collections.abc import Iterable, MutableMapping
from typing import Any

import ds_comm

__all__ = [
    "LoggerFactory",
    "get_caller_func",
    "get_current_level",
    "get_dist_msg",
    "get_log_level_from_string",
    "log_dist",
    "log_dist_once",
    "log_levels",
    "logger",
    "print_dist",
    "print_json_dist",
    "set_log_level_from_string",
    "should_log_le",
    "warning_once",
]

log_levels = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}

_FORMAT = "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s"


class LoggerFactory:
    """Builds DeepSpeed-style loggers (DeepSpeed's class of the same name)."""

    @staticmethod
    def create_logger(name: str | None = None, level: int = logging.WARNING) -> logging.Logger:
        """A logger called ``name`` writing to stdout at ``level``, not propagating to root.

        Calling it again for the same name keeps one handler (no duplicated lines).
        """
        if name is None:
            raise ValueError("create_logger(name=None): a logger needs a name, e.g. 'DeepSpeed'")
        made = logging.getLogger(name)
        made.setLevel(level)
        made.propagate = False
        ours = [h for h in made.handlers if getattr(h, "_ds_engine_handler", False)]
        if not ours:
            handler = logging.StreamHandler(stream=sys.stdout)
            handler._ds_engine_handler = True  # type: ignore[attr-defined]
            handler.setFormatter(logging.Formatter(_FORMAT))
            made.addHandler(handler)
            ours = [handler]
        for handler in ours:
            handler.setLevel(level)
        return made


logger = LoggerFactory.create_logger(name="DeepSpeed", level=logging.WARNING)


def _my_rank() -> int:
    return ds_comm.get_rank() if ds_comm.is_initialized() else -1


def _selected(ranks: Iterable[int] | None) -> bool:
    """DeepSpeed's rule: log without a process group; with one, only on the listed ranks
    (``[-1]``: every rank; None or empty: none)."""
    if not ds_comm.is_initialized():
        return True
    chosen = list(ranks or [])
    return bool(chosen) and (chosen[0] == -1 or _my_rank() in set(chosen))


def get_dist_msg(message: str, ranks: Iterable[int] | None = None) -> str | None:
    """``"[Rank r] message"`` when this rank should log it (see :func:`log_dist`), else None."""
    return f"[Rank {_my_rank()}] {message}" if _selected(ranks) else None


def log_dist(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the listed ranks (``[-1]``: all; everywhere without a process group).

    Example:
        >>> log_dist("loaded checkpoint", ranks=[0])  # "[Rank 0] loaded checkpoint" on rank 0
    """
    final = get_dist_msg(message, ranks)
    if final is not None:
        logger.log(level, final)


def print_dist(message: str, ranks: Iterable[int] | None = None) -> None:
    """Print ``message`` on the listed ranks, whatever the log level."""
    final = get_dist_msg(message, ranks)
    if final is not None:
        print(final)


@functools.lru_cache(None)
def _log_dist_once(message: str, ranks: tuple[int, ...] | None, level: int) -> None:
    log_dist(message, ranks=list(ranks) if ranks is not None else None, level=level)


def log_dist_once(
    message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO
) -> None:
    """:func:`log_dist`, each distinct message once per process."""
    _log_dist_once(message, tuple(ranks) if ranks is not None else None, level)


@functools.lru_cache(None)
def warning_once(*args: Any, **kwargs: Any) -> None:
    """``logger.warning`` once per distinct arguments."""
    logger.warning(*args, **kwargs)


logger.warning_once = warning_once  # type: ignore[attr-defined]
logger.log_dist_once = log_dist_once  # type: ignore[attr-defined]


def print_json_dist(
    message: MutableMapping[str, Any],
    ranks: Iterable[int] | None = None,
    path: str | os.PathLike[str] | None = None,
) -> None:
    """Write ``message`` (a dict, with ``"rank"`` added) as JSON to ``path`` on the listed ranks.

    Example:
        >>> print_json_dist({"loss": 0.5}, ranks=[0], path="metrics.json")
    """
    if not _selected(ranks):
        return
    if path is None:
        raise ValueError("print_json_dist(path=None): name the JSON file to write")
    message["rank"] = _my_rank()
    with open(path, "w") as out:
        json.dump(message, out)
        out.flush()
        os.fsync(out.fileno())


def get_log_level_from_string(log_level_str: str) -> int:
    """``"info"`` -> ``logging.INFO`` (any case); a clear error for an unknown name."""
    level = log_levels.get(log_level_str.lower())
    if level is None:
        raise ValueError(
            f"log level {log_level_str!r} is not one of {sorted(log_levels)}; pass one of them"
        )
    return level


def set_log_level_from_string(
    log_level_str: str, custom_logger: logging.Logger | None = None
) -> None:
    """Set ``custom_logger`` (default: :data:`logger`) and its handlers to the named level."""
    level = get_log_level_from_string(log_level_str)
    target = custom_logger if custom_logger is not None else logger
    target.setLevel(level)
    for handler in target.handlers:
        handler.setLevel(level)


def get_current_level() -> int:
    """The DeepSpeed logger's effective level."""
    return logger.getEffectiveLevel()


def should_log_le(max_log_level_str: str) -> bool:
    """Whether the current level is at most the named one (``"info"``: INFO or DEBUG)."""
    if not isinstance(max_log_level_str, str):
        raise ValueError(f"should_log_le({max_log_level_str!r}): expected a level name string")
    return get_current_level() <= get_log_level_from_string(max_log_level_str)


def get_caller_func(frame: int = 3) -> str:
    """The name of the function ``frame`` levels up the stack (DeepSpeed's comms logger uses
    it to name the caller of a collective)."""
    return sys._getframe(frame).f_code.co_name
