"""The batch-size triad: DeepSpeed's rules for completing and checking the three batch keys."""

from __future__ import annotations

from typing import Any

from ds_comm import ConfigError
from ds_comm.api import is_auto

__all__ = ["batch_key", "check_triad", "complete_triad"]


def batch_key(key: str, value: Any) -> int | None:
    """A batch key's value: a positive integer, or None when absent or ``"auto"`` (the
    placeholder Hugging Face clients fill in; left unresolved it counts as not given)."""
    if value is None or is_auto(value):
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f'{key} = {value!r}: expected a positive integer (or "auto")')
    return value


def _equation(train: int, micro: int, gas: int, world: int) -> str:
    return (
        f"train_batch_size ({train}) must equal train_micro_batch_size_per_gpu ({micro}) x "
        f"gradient_accumulation_steps ({gas}) x data-parallel size ({world}) = "
        f"{micro * gas * world}"
    )


def check_triad(train: int, micro: int, gas: int, world: int) -> None:
    if train != micro * gas * world:
        raise ConfigError(_equation(train, micro, gas, world))


def _divide(train: int, by: int, what: str, world: int) -> int:
    if train % by:
        raise ConfigError(
            f"train_batch_size = {train} is not divisible by {what} = {by} (data-parallel size "
            f"{world}); change train_batch_size or the other batch keys"
        )
    return train // by


def complete_triad(
    train: int | None, micro: int | None, gas: int | None, world: int
) -> tuple[int, int, int]:
    """DeepSpeed's rules: any two give the third; one of train/micro alone means gas = 1."""
    if train is not None and micro is not None and gas is not None:
        check_triad(train, micro, gas, world)
        return train, micro, gas
    if train is not None and micro is not None:
        gas = _divide(train, micro * world, "micro batch x data-parallel size", world)
    elif train is not None and gas is not None:
        micro = _divide(
            train, gas * world, "gradient_accumulation_steps x data-parallel size", world
        )
    elif micro is not None:
        gas = gas or 1
        train = micro * gas * world
    elif train is not None:
        gas = 1
        micro = _divide(train, world, "the data-parallel size", world)
    else:
        raise ConfigError(
            "train_batch_size and train_micro_batch_size_per_gpu are both missing: set at least "
            'one, e.g. "train_micro_batch_size_per_gpu": 8 ("auto" counts as missing: Hugging '
            "Face clients replace it before initialize)"
        )
    if micro < 1 or gas < 1:  # a quotient of 0
        check_triad(train, micro, gas, world)
    return train, micro, gas
