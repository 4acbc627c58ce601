"""The engine's data-efficiency surface: curriculum learning and progressive layer drop.

[Note: what the engine does for data efficiency]
- Legacy ``curriculum_learning``: before every training forward the scheduler moves to step
  ``global_steps + 1``; with ``curriculum_type`` ``"seqlen"`` the forward gets
  ``curriculum_seqlen=<difficulty>`` (the model truncates its inputs), as DeepSpeed does.
- ``progressive_layer_drop``: every training forward gets ``progressive_layer_drop=True,
  pld_theta=<theta>``; the theta moves at each step boundary (see ``_pld.py``).
- ``data_efficiency.data_sampling.curriculum_learning``: the training loader draws batches
  through ``DeepSpeedDataSampler`` (see ``_data_sampler.py``); ``set_data_post_process_func``
  and ``set_custom_curriculum_learning_schedule`` reach it.
The schedulers' states are saved in the checkpoint's engine state (``data_efficiency``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ds_engine._curriculum import CurriculumScheduler
from ds_engine._pld import ProgressiveLayerDrop

__all__ = [
    "DataEfficiencyMixin",
    "PipelineDataEfficiencyMixin",
    "refuse_pipeline_data_efficiency",
]


class DataEfficiencyMixin:
    """DeepSpeed's curriculum / PLD engine methods (see [Note: what the engine does for data
    efficiency]); mixed into the engine, which calls :meth:`_setup_data_efficiency`."""

    _config: Any
    module: Any
    global_steps: int
    training_dataloader: Any
    curriculum_scheduler_legacy: CurriculumScheduler | None
    progressive_layer_drop: ProgressiveLayerDrop | None

    def _setup_data_efficiency(self) -> None:
        legacy = self._config.curriculum_learning
        self.curriculum_scheduler_legacy = (
            CurriculumScheduler(legacy.params) if legacy.enabled else None
        )
        pld = self._config.progressive_layer_drop
        self.progressive_layer_drop = (
            ProgressiveLayerDrop(theta=pld.theta, gamma=pld.gamma) if pld.enabled else None
        )

    def _data_efficiency_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``kwargs`` of a forward with the PLD and seqlen-curriculum arguments added (training
        mode only)."""
        if not self.module.training:
            return kwargs
        if self.progressive_layer_drop is not None:
            kwargs = {**kwargs, **self.progressive_layer_drop.get_state()}
        scheduler = self.curriculum_scheduler_legacy
        if scheduler is not None:
            scheduler.update_difficulty(self.global_steps + 1)
            if self._config.curriculum_learning.curriculum_type == "seqlen":
                kwargs = {**kwargs, "curriculum_seqlen": scheduler.get_current_difficulty()}
        return kwargs

    def _data_efficiency_boundary(self) -> None:
        """At a step boundary, before the step is counted: move the PLD theta."""
        if self.progressive_layer_drop is not None:
            self.progressive_layer_drop.update_state(self.global_steps)

    # --- DeepSpeed's methods --------------------------------------------------------------------

    def get_pld_theta(self) -> float | None:
        """The current PLD keep ratio (None without ``progressive_layer_drop``)."""
        pld = self.progressive_layer_drop
        return pld.get_theta() if pld is not None else None

    def set_custom_curriculum_learning_schedule(
        self, schedule_func_dict: Mapping[str, Callable[[int], Any]]
    ) -> None:
        """Give the data-efficiency curriculum's ``custom`` metrics their ``step ->
        difficulty`` functions (metric name -> function)."""
        sampler = self._curriculum_sampler("set_custom_curriculum_learning_schedule")
        sampler.set_custom_curriculum_learning_schedule(schedule_func_dict)

    def set_data_post_process_func(
        self, post_process_func: Callable[[Any, dict[str, Any]], Any]
    ) -> None:
        """Have the curriculum loader pass each batch through ``post_process_func(batch,
        sampler_state)`` (e.g. truncate to ``sampler_state["current_difficulties"][metric]``)."""
        self._curriculum_sampler("set_data_post_process_func")
        self.training_dataloader.post_process_func = post_process_func

    def _curriculum_sampler(self, what: str) -> Any:
        loader = self.training_dataloader
        if not self._config.data_efficiency.curriculum_metrics:
            raise RuntimeError(
                f"{what}() acts on the data-efficiency curriculum, which this config does not "
                "enable: set data_efficiency.data_sampling.curriculum_learning.enabled (with "
                "curriculum_metrics)"
            )
        if loader is None or not hasattr(loader, "data_sampler"):
            raise RuntimeError(
                f"{what}() needs the engine's training loader: pass training_data= to "
                "initialize() (the curriculum sampler lives in that loader)"
            )
        return loader.data_sampler

    # --- checkpoints ----------------------------------------------------------------------------

    def data_efficiency_state(self) -> dict[str, Any]:
        """The schedulers' states, for the checkpoint's engine state."""
        legacy, pld = self.curriculum_scheduler_legacy, self.progressive_layer_drop
        return {
            "curriculum_scheduler_legacy": legacy.state_dict() if legacy is not None else None,
            "progressive_layer_drop": pld.state_dict() if pld is not None else None,
        }

    def load_data_efficiency_state(self, state: Mapping[str, Any] | None) -> None:
        """Restore :meth:`data_efficiency_state` (parts this engine does not run are skipped)."""
        if not state:
            return
        legacy, pld = self.curriculum_scheduler_legacy, self.progressive_layer_drop
        if legacy is not None and state.get("curriculum_scheduler_legacy"):
            legacy.load_state_dict(state["curriculum_scheduler_legacy"])
        if pld is not None and state.get("progressive_layer_drop"):
            pld.load_state_dict(state["progressive_layer_drop"])


def refuse_pipeline_data_efficiency(config: Any) -> None:
    """ConfigError for a pipeline config that enables curriculum learning or PLD: the pipeline
    engine runs its stages itself and passes no forward keyword arguments."""
    enabled = [
        key
        for key, on in (
            ("curriculum_learning.enabled", config.curriculum_learning.enabled),
            ("progressive_layer_drop.enabled", config.progressive_layer_drop.enabled),
            (
                "data_efficiency.data_sampling.curriculum_learning.enabled",
                bool(config.data_efficiency.curriculum_metrics),
            ),
        )
        if on
    ]
    if enabled:
        from ds_comm import ConfigError

        raise ConfigError(
            f"{enabled[0]} = true with a PipelineModule: curriculum learning and progressive "
            "layer drop are implemented for the DeepSpeedEngine only (they reach the model "
            "through forward keyword arguments, which pipeline stages do not take); set it to "
            "false or train without a pipeline"
        )


class PipelineDataEfficiencyMixin:
    """The pipeline engine's side of the surface: curriculum and PLD are refused for pipelines
    (see :func:`refuse_pipeline_data_efficiency`), so there is never a schedule to reach."""

    def get_pld_theta(self) -> float | None:
        """None: progressive layer drop does not run under the pipeline engine."""
        return None

    def set_custom_curriculum_learning_schedule(
        self, schedule_func_dict: Mapping[str, Callable[[int], Any]]
    ) -> None:
        """Refused: the data-efficiency curriculum is not implemented for pipelines."""
        raise RuntimeError(_PIPELINE_CURRICULUM.format("set_custom_curriculum_learning_schedule"))

    def set_data_post_process_func(
        self, post_process_func: Callable[[Any, dict[str, Any]], Any]
    ) -> None:
        """Refused: the data-efficiency curriculum is not implemented for pipelines."""
        raise RuntimeError(_PIPELINE_CURRICULUM.format("set_data_post_process_func"))


_PIPELINE_CURRICULUM = (
    "PipelineEngine.{}(): the data-efficiency curriculum is implemented for the "
    "DeepSpeedEngine only, not for pipelines (a pipeline config that enables it is refused)"
)
