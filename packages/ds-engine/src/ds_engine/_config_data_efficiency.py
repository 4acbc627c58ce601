"""The ``curriculum_learning``, ``progressive_layer_drop`` and ``data_efficiency`` sections.

Frozen keyword-only dataclasses with DeepSpeed's key names and defaults, built with
``from_dict``. What ds implements (see docs/data_efficiency.md): the legacy seqlen curriculum,
progressive layer drop, and the data-efficiency curriculum over ``single_cluster`` metrics
(seqlen-style metrics whose difficulty the client applies, e.g. by truncating in a
``set_data_post_process_func`` function). Refused, naming the key: metrics sampled through
data-analysis index files (any other ``clustering_type``), dynamic batching and random-LTD.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ds_comm import ConfigError
from ds_comm.api import as_section, check_keys, is_auto, without_auto
from ds_engine._config_features import Section
from ds_engine._curriculum import check_schedule

__all__ = ["CurriculumLegacyConfig", "DataEfficiencyConfig", "ProgressiveLayerDropConfig"]

_DE = "data_efficiency"
_SCHEDULE_KEYS = ("min_difficulty", "max_difficulty", "schedule_type", "schedule_config")
_METRIC_KEYS = (
    "index_to_sample_path",
    "index_to_metric_path",
    "difficulty_type",
    "clustering_type",
    *_SCHEDULE_KEYS,
)
_SAMPLING_DEFAULTS: dict[str, Any] = {
    "enabled": False,
    "num_epochs": 1000,
    "num_workers": 0,
    "pin_memory": False,
    "curriculum_learning": {"enabled": False},
    "dynamic_batching": {"enabled": False},
}
_ROUTING_DEFAULTS: dict[str, Any] = {
    "enabled": False,
    "random_ltd": {"enabled": False, "layer_token_lr_schedule": {"enabled": False}},
}


def _flag(where: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where} = {value!r}: expected true or false")
    return value


def _merge(default: Mapping[str, Any], value: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(default)
    for key, given in value.items():
        inner = default.get(key)
        if isinstance(inner, Mapping) and isinstance(given, Mapping):
            merged[key] = _merge(inner, given)
        elif not is_auto(given):
            merged[key] = given
    return merged


@dataclass(frozen=True, kw_only=True)
class CurriculumLegacyConfig:
    """The legacy top-level ``curriculum_learning`` section.

    Attributes:
        enabled: run the curriculum.
        curriculum_type: what the difficulty is; with ``"seqlen"`` every training forward gets
            ``curriculum_seqlen=<difficulty>`` as a keyword argument (the model truncates).
            Other types are tracked (``engine.curriculum_scheduler_legacy``) for the client.
        min_difficulty, max_difficulty, schedule_type, schedule_config: the schedule
            (``fixed_linear``, ``fixed_root``, ``fixed_discrete`` or ``custom``).
    """

    enabled: bool = False
    curriculum_type: str | None = None
    min_difficulty: int | float | None = None
    max_difficulty: int | float | None = None
    schedule_type: str | None = None
    schedule_config: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        _flag("curriculum_learning.enabled", self.enabled)
        if not self.enabled:
            return
        if not isinstance(self.curriculum_type, str):
            raise ConfigError(
                f"curriculum_learning.curriculum_type = {self.curriculum_type!r}: expected a "
                'name, e.g. "seqlen" (the model gets curriculum_seqlen=<difficulty>)'
            )
        check_schedule("curriculum_learning", self.params)

    @classmethod
    def from_dict(cls, section: Any) -> CurriculumLegacyConfig:
        values = as_section("curriculum_learning", section)
        check_keys("curriculum_learning", values, ("enabled", "curriculum_type", *_SCHEDULE_KEYS))
        return cls(**without_auto(values))

    @property
    def params(self) -> dict[str, Any]:
        """DeepSpeed's ``curriculum_params_legacy()``: the given keys other than ``enabled``."""
        keys = ("curriculum_type", *_SCHEDULE_KEYS)
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


@dataclass(frozen=True, kw_only=True)
class ProgressiveLayerDropConfig:
    """The ``progressive_layer_drop`` section.

    Attributes:
        enabled: pass ``progressive_layer_drop=True, pld_theta=...`` to training forwards.
        theta: the keep ratio the schedule decays towards, in (0, 1].
        gamma: the decay rate, >= 0.
    """

    enabled: bool = False
    theta: float = 1.0
    gamma: float = 0.001

    def __post_init__(self) -> None:
        _flag("progressive_layer_drop.enabled", self.enabled)
        theta, gamma = self.theta, self.gamma
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta <= 1:
            raise ConfigError(
                f"progressive_layer_drop.theta = {theta!r}: expected a keep ratio in (0, 1] "
                "(DeepSpeed's example uses 0.5)"
            )
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or gamma < 0:
            raise ConfigError(
                f"progressive_layer_drop.gamma = {gamma!r}: expected a decay rate >= 0 "
                "(DeepSpeed's default 0.001)"
            )

    @classmethod
    def from_dict(cls, section: Any) -> ProgressiveLayerDropConfig:
        values = as_section("progressive_layer_drop", section)
        check_keys("progressive_layer_drop", values, ("enabled", "theta", "gamma"))
        return cls(**without_auto(values))

    @property
    def params(self) -> dict[str, float]:
        """DeepSpeed's ``pld_params()``: ``theta`` and ``gamma``."""
        return {"theta": self.theta, "gamma": self.gamma}


@dataclass(frozen=True, kw_only=True)
class DataEfficiencyConfig:
    """The ``data_efficiency`` section (DeepSpeed's data efficiency library).

    Attributes:
        enabled: DeepSpeed's master switch (read by clients; each technique has its own).
        seed: the seed of the curriculum sampler's shuffles.
        data_sampling: ``enabled``, ``num_epochs``, ``num_workers``, ``pin_memory``,
            ``curriculum_learning`` (``enabled``, ``data_cluster_path``,
            ``curriculum_metrics``: metric name -> schedule) and ``dynamic_batching``.
        data_routing: ``enabled`` and ``random_ltd`` (refused when enabled).
        tree: the whole section merged over DeepSpeed's defaults, as DeepSpeed's
            ``data_efficiency_config()`` returns it.
    """

    enabled: bool = False
    seed: int = 1234
    data_sampling: Mapping[str, Any] = field(default_factory=dict)
    data_routing: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _flag(f"{_DE}.enabled", self.enabled)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"{_DE}.seed = {self.seed!r}: expected an integer")
        sampling = _merge(
            _SAMPLING_DEFAULTS, as_section(f"{_DE}.data_sampling", self.data_sampling)
        )
        routing = _merge(_ROUTING_DEFAULTS, as_section(f"{_DE}.data_routing", self.data_routing))
        check_keys(f"{_DE}.data_sampling", sampling, _SAMPLING_DEFAULTS)
        check_keys(f"{_DE}.data_routing", routing, _ROUTING_DEFAULTS)
        _check_sampling(sampling)
        _check_routing(routing)
        object.__setattr__(self, "data_sampling", Section(sampling))
        object.__setattr__(self, "data_routing", Section(routing))

    @classmethod
    def from_dict(cls, section: Any) -> DataEfficiencyConfig:
        values = as_section(_DE, section)
        check_keys(_DE, values, ("enabled", "seed", "data_sampling", "data_routing"))
        return cls(**without_auto(values))

    @property
    def tree(self) -> Section:
        """DeepSpeed's ``data_efficiency_config()`` dict (read-only)."""
        return Section(
            {
                "enabled": self.enabled,
                "seed": self.seed,
                "data_sampling": self.data_sampling,
                "data_routing": self.data_routing,
            }
        )

    @property
    def curriculum_metrics(self) -> dict[str, dict[str, Any]]:
        """Metric name -> its schedule, when the data-sampling curriculum is enabled."""
        curriculum = self.data_sampling["curriculum_learning"]
        if not curriculum["enabled"]:
            return {}
        metrics = curriculum["curriculum_metrics"]
        return {name: dict(m.to_dict()) for name, m in metrics.items()}


def _check_sampling(sampling: Mapping[str, Any]) -> None:
    where = f"{_DE}.data_sampling"
    for key in ("enabled", "pin_memory"):
        _flag(f"{where}.{key}", sampling[key])
    for key in ("num_epochs", "num_workers"):
        value = sampling[key]
        low = 1 if key == "num_epochs" else 0
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"{where}.{key} = {value!r}: expected an integer >= {low}")
    dynamic = as_section(f"{where}.dynamic_batching", sampling["dynamic_batching"])
    if dynamic.get("enabled", False):
        raise ConfigError(
            f"{where}.dynamic_batching.enabled = true asks for dynamic batching (variable batch "
            "size and LR scaling), which is not implemented in ds; set it to false"
        )
    curriculum = as_section(f"{where}.curriculum_learning", sampling["curriculum_learning"])
    check_keys(
        f"{where}.curriculum_learning",
        curriculum,
        ("enabled", "data_cluster_path", "curriculum_metrics"),
    )
    if not _flag(f"{where}.curriculum_learning.enabled", curriculum.get("enabled", False)):
        return
    metrics = curriculum.get("curriculum_metrics")
    if not isinstance(metrics, Mapping) or not metrics:
        raise ConfigError(
            f"{where}.curriculum_learning.curriculum_metrics = {metrics!r}: curriculum learning "
            'is enabled, so give at least one metric, e.g. {"seqlen_truncate": {...}}'
        )
    for name, metric in metrics.items():
        _check_metric(f"{where}.curriculum_learning.curriculum_metrics.{name}", metric)


def _check_metric(where: str, metric: Any) -> None:
    metric = as_section(where, metric)
    check_keys(where, metric, _METRIC_KEYS)
    clustering = metric.get("clustering_type", "single_cluster")
    if clustering != "single_cluster":
        raise ConfigError(
            f"{where}.clustering_type = {clustering!r} asks for index-based curriculum sampling "
            "(data_analysis index_to_sample/index_to_metric files), which is not implemented "
            'in ds; use "single_cluster" and apply the difficulty in the data post-process '
            "function (engine.set_data_post_process_func), as seqlen_truncate does"
        )
    difficulty = metric.get("difficulty_type", "value")
    if difficulty not in ("value", "percentile"):
        raise ConfigError(
            f'{where}.difficulty_type = {difficulty!r}: expected "value" or "percentile"'
        )
    check_schedule(where, metric)


def _check_routing(routing: Mapping[str, Any]) -> None:
    where = f"{_DE}.data_routing"
    _flag(f"{where}.enabled", routing["enabled"])
    ltd = as_section(f"{where}.random_ltd", routing["random_ltd"])
    if ltd.get("enabled", False):
        raise ConfigError(
            f"{where}.random_ltd.enabled = true asks for random layer-token drop (random-LTD), "
            "which is not implemented in ds; set it to false"
        )
