"""``deepspeed.runtime.sequence_parallel.ulysses_sp``: ``UlyssesSPDataLoaderAdapter``.

The rest of DeepSpeed's ALST module (the Hugging Face attention hook, tiled MLP and tiled loss,
the compilable all-to-all's group registration) is importable and refused when used; ``logger``
is DeepSpeed's logger.
"""

from __future__ import annotations

from typing import Any, NoReturn

from ds_engine._not_implemented import not_implemented
from ds_engine.sequence._loader import UlyssesSPDataLoaderAdapter
from ds_engine.utils.logging import logger

__all__ = [
    "AutogradComputeMLP",
    "SequenceTiledCompute",
    "TiledFusedLogitsLoss",
    "TiledMLP",
    "UlyssesSPAttentionHF",
    "UlyssesSPDataLoaderAdapter",
    "logger",
    "register_all_to_all_group",
    "sequence_tiled_compute",
]

_PATH = "deepspeed.runtime.sequence_parallel.ulysses_sp"
UlyssesSPAttentionHF = not_implemented(
    f"{_PATH}.UlyssesSPAttentionHF",
    "the Hugging Face attention hook of ALST; wrap your attention in "
    "deepspeed.sequence.layer.DistributedAttention and set sequence_parallel_size",
)


def _refuse_registration(*args: Any, **kwargs: Any) -> NoReturn:
    raise NotImplementedError(
        f"{_PATH}.UlyssesSPAttentionHF.register_with_transformers (patching Hugging Face "
        "attention for Ulysses) is not implemented in ds; wrap the attention in "
        "deepspeed.sequence.layer.DistributedAttention and set sequence_parallel_size "
        "(docs/sequence_parallel.md)"
    )


# Accelerate calls it on the class (its sp_backend="deepspeed" path): refuse by name there too.
UlyssesSPAttentionHF.register_with_transformers = staticmethod(_refuse_registration)  # type: ignore[attr-defined]
TiledMLP = not_implemented(f"{_PATH}.TiledMLP", "ALST's tiled MLP")
SequenceTiledCompute = not_implemented(f"{_PATH}.SequenceTiledCompute", "ALST's tiled compute")
sequence_tiled_compute = not_implemented(f"{_PATH}.sequence_tiled_compute", "ALST's tiled compute")
TiledFusedLogitsLoss = not_implemented(f"{_PATH}.TiledFusedLogitsLoss", "ALST's tiled loss")
AutogradComputeMLP = not_implemented(f"{_PATH}.AutogradComputeMLP", "ALST's tiled MLP")
register_all_to_all_group = not_implemented(
    f"{_PATH}.register_all_to_all_group", "the compilable all-to-all op of DeepSpeed's layer"
)
