"""``deepspeed.runtime.data_pipeline.data_sampling.data_sampler``: the sampler the training
loader uses under ``data_efficiency``'s curriculum (``single_cluster`` metrics)."""

from __future__ import annotations

from ds_engine._data_sampler import DeepSpeedDataSampler

__all__ = ["DeepSpeedDataSampler"]
