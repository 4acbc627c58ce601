"""The launcher's own messages, filtered by ``--log_level`` (DeepSpeed's levels).

[Note: launcher messages]
What ds-launch says about a launch goes to stderr, one whole line per message, prefixed
``ds-launch: `` (stdout carries the ranks' output and ``--dry_run``'s JSON). The level of each:

* ``debug``: every rank's command and launch variables, and the variables exported to ranks;
* ``info`` (DeepSpeed's default): the resources used, the ``.deepspeed_env`` files read, the
  command started on each node, and each node's ranks as they start;
* ``warning``: guesses made for the user (one CPU rank without GPUs) and signals passed on;
* ``error``: the failing rank or node, with its last lines, and the ranks being stopped.

``-q``/``--quiet`` is ``--log_level error``, as in DeepSpeed. Usage errors (exit code 2) are
always printed. The level is an explicit object handed to whoever prints, not a global logger,
so ``launch()`` called from Python leaves the caller's logging alone. The ranks' own output is
never filtered.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from ds_launch.api import DEFAULT_LOG_LEVEL, LOG_LEVELS


@dataclass(frozen=True)
class Console:
    """Prints launcher messages at or above ``level`` to stderr (see [Note: launcher messages]).

    Attributes:
        level: one of ``LOG_LEVELS``.
        prefix: what every line starts with.
    """

    level: str = DEFAULT_LOG_LEVEL
    prefix: str = "ds-launch"

    def enabled(self, level: str) -> bool:
        """Whether a message of ``level`` is printed."""
        return LOG_LEVELS.index(level) >= LOG_LEVELS.index(self.level)

    def say(self, level: str, text: str) -> None:
        """Print ``text`` if ``level`` is enabled; only its first line gets the prefix."""
        if not self.enabled(level):
            return
        sys.stderr.write(f"{self.prefix}: {text}\n")
        sys.stderr.flush()

    def debug(self, text: str) -> None:
        self.say("debug", text)

    def info(self, text: str) -> None:
        self.say("info", text)

    def warning(self, text: str) -> None:
        self.say("warning", text)

    def error(self, text: str) -> None:
        self.say("error", text)
