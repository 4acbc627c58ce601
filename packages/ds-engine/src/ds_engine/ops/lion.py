"""``deepspeed.ops.lion``: ds-optim's Lion under DeepSpeed's names.

``ds_optim.Lion`` runs on parameters on any device, so it is both DeepSpeed's CPU Lion (ZeRO
offload) and its fused GPU Lion.
"""

from __future__ import annotations

from ds_optim import Lion

DeepSpeedCPULion = Lion
FusedLion = Lion

__all__ = ["DeepSpeedCPULion", "FusedLion"]
