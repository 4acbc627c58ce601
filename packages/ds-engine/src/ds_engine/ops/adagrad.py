"""``deepspeed.ops.adagrad``: ds-optim's Adagrad under DeepSpeed's name (it runs on parameters
on any device, CPU included)."""

from __future__ import annotations

from ds_optim import Adagrad

DeepSpeedCPUAdagrad = Adagrad

__all__ = ["DeepSpeedCPUAdagrad"]
