"""``deepspeed.runtime.data_pipeline``: DeepSpeed's data efficiency module paths.

``curriculum_scheduler`` (:class:`CurriculumScheduler`) and ``data_sampling.data_sampler``
(:class:`DeepSpeedDataSampler`); see docs/data_efficiency.md. Random-LTD (``data_routing``) is
not implemented in ds.
"""

from __future__ import annotations

from ds_engine.runtime.data_pipeline import curriculum_scheduler, data_sampling

__all__ = ["curriculum_scheduler", "data_sampling"]
