"""``deepspeed.runtime.data_pipeline.data_sampling``: the curriculum data sampler."""

from __future__ import annotations

from ds_engine.runtime.data_pipeline.data_sampling import data_sampler

__all__ = ["data_sampler"]
