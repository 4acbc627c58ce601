"""Curriculum schedules: the difficulty (e.g. a sequence length) to train at, step by step.

[Note: DeepSpeed's curriculum schedules]
A schedule maps a step number to a difficulty between ``min_difficulty`` and
``max_difficulty``:

- ``fixed_linear``: ``floor(step / total_curriculum_step * (max - min) + min)``, rounded down
  to a multiple of ``difficulty_step``;
- ``fixed_root``: the same with ``(step / total_curriculum_step) ** (1 / root_degree)``;
- ``fixed_discrete``: ``difficulty[i]`` for the first ``i`` with ``step <= max_step[i]``, the
  last difficulty after the last ``max_step`` (one more difficulty than max steps);
- ``custom``: a function of the step that the client sets
  (``engine.set_custom_curriculum_learning_schedule``).

For the two root schedules the result is at least the first multiple of ``difficulty_step`` at
or above ``min_difficulty`` (DeepSpeed 0.19's guard against a zero sequence length) and at most
``max_difficulty``. ``update_difficulty(step)`` moves the current difficulty only while it is
below the maximum, so a reached maximum stays. The scheduler's whole state is a small dict
(``get_state``/``state_dict``), saved with the engine's checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from ds_comm import ConfigError

__all__ = ["SCHEDULE_TYPES", "CurriculumScheduler", "check_schedule"]

SCHEDULE_TYPES = ("fixed_linear", "fixed_root", "fixed_discrete", "custom")
_SCHEDULE_KEYS: dict[str, tuple[str, ...]] = {
    "fixed_linear": ("total_curriculum_step", "difficulty_step"),
    "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
    "fixed_discrete": ("difficulty", "max_step"),
    "custom": (),
}


def _positive_int(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{where} = {value!r}: expected a positive integer")
    return value


def check_schedule(where: str, config: Mapping[str, Any]) -> None:
    """Validate one curriculum's ``min_difficulty``, ``max_difficulty``, ``schedule_type`` and
    ``schedule_config`` (``where`` names the section in errors)."""
    for key in ("min_difficulty", "max_difficulty", "schedule_type"):
        if key not in config:
            raise ConfigError(f"{where}.{key} is required for curriculum learning")
    kind = config["schedule_type"]
    if kind not in SCHEDULE_TYPES:
        raise ConfigError(
            f"{where}.schedule_type = {kind!r}: expected one of {list(SCHEDULE_TYPES)}"
        )
    low, high = config["min_difficulty"], config["max_difficulty"]
    for key, value in (("min_difficulty", low), ("max_difficulty", high)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}.{key} = {value!r}: expected a number")
    if low > high:
        raise ConfigError(
            f"{where}.min_difficulty = {low!r} is above max_difficulty = {high!r}; swap them"
        )
    schedule = config.get("schedule_config", {})
    if kind == "custom":
        return
    if not isinstance(schedule, Mapping):
        raise ConfigError(f"{where}.schedule_config = {schedule!r}: expected a JSON object")
    for key in _SCHEDULE_KEYS[kind]:
        if key not in schedule:
            raise ConfigError(
                f"{where}.schedule_config.{key} is required by schedule_type {kind!r} "
                f"(which needs {list(_SCHEDULE_KEYS[kind])})"
            )
    if kind == "fixed_discrete":
        _check_discrete(f"{where}.schedule_config", schedule)
        return
    _positive_int(
        f"{where}.schedule_config.total_curriculum_step", schedule["total_curriculum_step"]
    )
    _positive_int(f"{where}.schedule_config.difficulty_step", schedule["difficulty_step"])
    if kind == "fixed_root":
        degree = schedule["root_degree"]
        if isinstance(degree, bool) or not isinstance(degree, (int, float)) or degree <= 0:
            raise ConfigError(
                f"{where}.schedule_config.root_degree = {degree!r}: expected a number > 0 "
                "(2 is a square root, 1 is linear)"
            )


def _check_discrete(where: str, schedule: Mapping[str, Any]) -> None:
    levels, steps = schedule["difficulty"], schedule["max_step"]
    if not isinstance(levels, list) or not isinstance(steps, list) or not steps:
        raise ConfigError(
            f"{where}: difficulty and max_step must be non-empty lists, got "
            f"difficulty = {levels!r}, max_step = {steps!r}"
        )
    if len(levels) != len(steps) + 1:
        raise ConfigError(
            f"{where}: difficulty has {len(levels)} entries and max_step {len(steps)}; give "
            "one more difficulty than max steps (the last one holds after the last max_step)"
        )


class CurriculumScheduler:
    """DeepSpeed's ``CurriculumScheduler``: one curriculum's difficulty per step (see
    [Note: DeepSpeed's curriculum schedules]).

    Args:
        config: ``min_difficulty``, ``max_difficulty``, ``schedule_type`` and (except for
            ``custom``) ``schedule_config``, as in DeepSpeed's config.

    Example:
        >>> s = CurriculumScheduler({"min_difficulty": 8, "max_difficulty": 64,
        ...     "schedule_type": "fixed_linear",
        ...     "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8}})
        >>> s.update_difficulty(5)
        32
    """

    def __init__(self, config: Mapping[str, Any]) -> None:
        check_schedule("curriculum", config)
        self.state: dict[str, Any] = {
            "min_difficulty": config["min_difficulty"],
            "max_difficulty": config["max_difficulty"],
            "current_difficulty": config["min_difficulty"],
            "schedule_type": config["schedule_type"],
        }
        if config["schedule_type"] != "custom":
            self.state["schedule_config"] = dict(config["schedule_config"])
        self.custom_get_difficulty: Callable[[int], Any] | None = None
        self.first_step = True  # read by pipeline schedules that reset activation shapes

    # --- DeepSpeed's methods ------------------------------------------------------------------

    def set_custom_get_difficulty(self, schedule_function: Callable[[int], Any]) -> None:
        """Use ``schedule_function(step) -> difficulty`` (the ``custom`` schedule type)."""
        self.custom_get_difficulty = schedule_function

    def get_current_difficulty(self) -> Any:
        """The difficulty set by the last :meth:`update_difficulty`."""
        return self.state["current_difficulty"]

    def set_current_difficulty(self, difficulty: Any) -> None:
        """Overwrite the current difficulty."""
        self.state["current_difficulty"] = difficulty

    def get_state(self) -> dict[str, Any]:
        """The scheduler's state dict (the live object, as DeepSpeed returns it)."""
        return self.state

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Replace the state with a saved one."""
        self.state = dict(state)

    def get_difficulty(self, global_steps: int) -> Any:
        """The schedule's difficulty at ``global_steps`` (does not change the state)."""
        kind = self.state["schedule_type"]
        if kind == "fixed_discrete":
            return self._discrete(global_steps)
        if kind == "fixed_linear":
            return self._root(global_steps, 1.0)
        if kind == "fixed_root":
            return self._root(global_steps, self.state["schedule_config"]["root_degree"])
        if self.custom_get_difficulty is None:
            raise RuntimeError(
                'curriculum schedule_type "custom" has no schedule function: call '
                "engine.set_custom_curriculum_learning_schedule(...) (or "
                "set_custom_get_difficulty on the scheduler) before training"
            )
        return self.custom_get_difficulty(global_steps)

    def update_difficulty(self, global_steps: int) -> Any:
        """Move to the schedule's difficulty at ``global_steps`` unless the maximum is already
        reached; returns the current difficulty."""
        if self.state["current_difficulty"] < self.state["max_difficulty"]:
            self.state["current_difficulty"] = self.get_difficulty(global_steps)
        return self.state["current_difficulty"]

    # --- checkpoints (torch-style names) --------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """A copy of the state, for checkpoints."""
        return dict(self.state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` (the custom function is kept: code is not saved)."""
        self.set_state(state)

    # --- schedules ----------------------------------------------------------------------------

    def _discrete(self, step: int) -> Any:
        schedule = self.state["schedule_config"]
        levels, max_steps = schedule["difficulty"], schedule["max_step"]
        for level, last in zip(levels, max_steps, strict=False):
            if step <= last:
                return level
        return levels[-1]

    def _root(self, step: int, degree: float) -> int:
        schedule = self.state["schedule_config"]
        low, high = self.state["min_difficulty"], self.state["max_difficulty"]
        quantum = schedule["difficulty_step"]
        fraction = (float(step) / schedule["total_curriculum_step"]) ** (1.0 / degree)
        value = math.floor(fraction * (high - low) + low)
        value -= value % quantum
        first = -(-low // quantum) * quantum  # the first multiple of the step >= min
        return min(max(value, first), high)
