"""``deepspeed.runtime.data_pipeline.curriculum_scheduler``: the curriculum schedules."""

from __future__ import annotations

from ds_engine._curriculum import CurriculumScheduler

__all__ = ["CurriculumScheduler"]
