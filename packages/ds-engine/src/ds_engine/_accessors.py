"""DeepSpeed's config accessors, shared by the engine and the pipeline engine."""

from __future__ import annotations

from ds_engine.api import DeepSpeedConfig

__all__ = ["ConfigAccessors"]


class ConfigAccessors:
    """``train_batch_size()`` & co. read from ``self.config`` (DeepSpeed's engine methods)."""

    config: DeepSpeedConfig

    def train_batch_size(self) -> int:
        """Samples per optimizer step over all data-parallel ranks."""
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per forward/backward on one rank."""
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return self.config.gradient_accumulation_steps

    def zero_optimization_stage(self) -> int:
        """The ZeRO stage (0: plain data parallelism)."""
        return self.config.zero_optimization.stage

    def fp16_enabled(self) -> bool:
        """True when training in fp16 with loss scaling."""
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        """True when training in bf16."""
        return self.config.bf16.enabled
