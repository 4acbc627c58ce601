"""Autotuning: predict each candidate config's memory per rank, time only those that fit.

``ds-autotune`` (and ``ds-launch --autotuning tune|run``) drive :mod:`._tuner`; an experiment is
the user's script run with ``autotuning.enabled``, whose engine measures itself
(:mod:`._probe`). See docs/autotuning.md.
"""

from __future__ import annotations

from ds_engine.autotuning._config import METRICS, TUNER_TYPES, AutotuningConfig
from ds_engine.autotuning._live_bytes import LiveTensorBytes, PeakMemory
from ds_engine.autotuning._probe import AutotuningProbe, start_probe

__all__ = [
    # config
    "METRICS",
    "TUNER_TYPES",
    "AutotuningConfig",
    # measurement
    "AutotuningProbe",
    "LiveTensorBytes",
    "PeakMemory",
    "start_probe",
]
