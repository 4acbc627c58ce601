"""Top-level config keys for DeepSpeed features ds does not implement: one table, one rule.

[Note: refused only when requested]
DeepSpeed's config documents about sixty top-level keys. Those whose feature ds implements are
typed fields of :class:`ds_engine.DeepSpeedConfig`. Every other one is a row of
:data:`NOT_IMPLEMENTED`: the feature it switches on and DeepSpeed's default value. One rule
decides whether a given value *asks for* the feature:

- a section with an ``enabled`` switch asks for nothing while the switch is false (whatever its
  other settings say: ``"torch_autocast": {"enabled": false, "dtype": "bfloat16"}`` is inert);
- any other value asks for nothing when it equals DeepSpeed's default, key by key (``"auto"``
  stands for the default, as in DeepSpeed's config models);
- an *open* section (``compression_training``, ``weight_quantization``, ...: deep trees of
  per-technique settings) asks for something when any ``enabled`` inside it is true.

A value that asks for nothing is accepted and kept (merged over the defaults) in
``DeepSpeedConfig.unimplemented``, where the engine's accessors read it
(``torch_autocast_enabled()`` is ``unimplemented.torch_autocast.enabled``). A value that asks
for the feature is a ConfigError naming the key and the feature. Sub-keys of closed sections are
checked against DeepSpeed's names, so a misspelling gets the did-you-mean error even in a
disabled section.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ds_comm import ConfigError
from ds_comm.api import check_keys, is_auto

__all__ = ["NOT_IMPLEMENTED", "FeatureSettings", "NotImplementedFeature", "Section"]


class Section(Mapping[str, Any]):
    """A read-only config section: DeepSpeed's defaults overlaid with the user's values, readable
    as attributes (``section.enabled``) or keys (``section["enabled"]``)."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        self._values = {k: Section(v) if isinstance(v, Mapping) else v for k, v in values.items()}

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_values"][name]
        except KeyError:
            raise AttributeError(name) from None

    def __repr__(self) -> str:
        return f"Section({self.to_dict()!r})"

    def to_dict(self) -> dict[str, Any]:
        """A plain (mutable, nested) dict copy."""
        return {k: v.to_dict() if isinstance(v, Section) else v for k, v in self._values.items()}


@dataclass(frozen=True)
class NotImplementedFeature:
    """One row of :data:`NOT_IMPLEMENTED`.

    Attributes:
        feature: what the key switches on, for the error message.
        default: DeepSpeed's default: a scalar, or a dict of the section's keys and defaults.
        open: the section's contents are a deep tree; only nested ``enabled`` flags are read
            (without any, ``switched=False``, any content asks for the feature).
        switched: an open section whose techniques carry ``enabled`` flags.
        inert: further values of a sub-key that ask for nothing (``autotp_size`` 1 is no
            tensor parallelism, like DeepSpeed's default 0).
        switch: the name of the on/off flags (``compile`` uses ``deepcompile``).
        note: extra advice for the error message (e.g. what to use instead).
        implemented_by: the ds module that implements the section with DeepSpeed's layout:
            values that ask for the feature are accepted (sub-keys still checked).
        implemented_keys: sub-keys ds implements (any value asks for nothing here; the module
            named in the note reads them), the section's other keys still refused.
    """

    feature: str
    default: Any
    open: bool = False
    switched: bool = True
    inert: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    switch: str = "enabled"
    note: str = ""
    implemented_by: str = ""
    implemented_keys: tuple[str, ...] = ()

    def requested(self, key: str, value: Any) -> bool:
        """Whether ``value`` of top-level ``key`` asks for the feature (see [Note: refused
        only when requested]); ConfigError for a malformed section or an unknown sub-key."""
        if value is None or is_auto(value):
            return False
        if not isinstance(self.default, Mapping):
            return not _same(value, self.default)
        if isinstance(value, bool) and not value:
            return False  # "section": false, DeepSpeed's shorthand for off
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key} = {value!r}: expected a JSON object (a section)")
        if self.open:
            return _any_enabled(value, self.switch) if self.switched else bool(value)
        _check_sub_keys(key, value, self.default)
        if self.switch in self.default:
            enabled = value.get(self.switch, self.default[self.switch])
            return bool(enabled) and not is_auto(enabled)
        return any(
            not _same(v, self.default[k])
            and k not in self.implemented_keys
            and not any(_same(v, i) for i in self.inert.get(k, ()))
            for k, v in value.items()
        )

    def settings(self, value: Any) -> Any:
        """The accepted value merged over the default (a :class:`Section` for sections)."""
        if not isinstance(self.default, Mapping):
            return self.default if value is None or is_auto(value) else value
        return Section(_merge(self.default, value))

    def refusal(self, key: str, value: Any) -> ConfigError:
        """The error for a value that asks for the feature."""
        if self.open and self.switched:
            fix = 'set every "enabled" inside it to false, or remove it'
        elif self.open and self.switch != "enabled":
            fix = f'set "{self.switch}" to false, or remove it'
        elif self.open:
            fix = "remove it"
        elif isinstance(self.default, Mapping) and "enabled" in self.default:
            fix = f'set "{key}": {{"enabled": false}} or remove it'
        elif isinstance(self.default, Mapping):
            fix = f"remove it or leave its keys at DeepSpeed's defaults {dict(self.default)}"
        else:
            fix = f"remove it or set DeepSpeed's default {self.default!r}"
        note = f" {self.note}" if self.note else ""
        return ConfigError(
            f"{key} = {value!r} asks for {self.feature}, which is not implemented in ds; {fix}."
            f"{note}"
        )


def _same(value: Any, default: Any) -> bool:
    """``value`` equals ``default`` (bools are not numbers; "auto" is the default)."""
    if is_auto(value):
        return True
    if isinstance(default, Mapping) and isinstance(value, Mapping):
        return all(k in default and _same(v, default[k]) for k, v in value.items())
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    if isinstance(value, str) and isinstance(default, str):
        return value.lower() == default.lower()  # DeepSpeed lower-cases its names ("MEAN")
    return bool(value == default)


def _merge(default: Mapping[str, Any], value: Any) -> dict[str, Any]:
    """``value`` over ``default``, nested sections merged key by key, "auto" left out."""
    merged = dict(default)
    if isinstance(value, Mapping):
        for key, given in value.items():
            if is_auto(given):
                continue
            inner = default.get(key)
            both = isinstance(inner, Mapping) and isinstance(given, Mapping)
            merged[key] = _merge(inner, given) if both else given  # pyright: ignore[reportArgumentType]  (both: inner is a Mapping)
    return merged


def _any_enabled(value: Any, switch: str) -> bool:
    """Whether any ``switch`` flag in a nested section is true."""
    if isinstance(value, Mapping):
        if value.get(switch, False) is True:
            return True
        return any(_any_enabled(v, switch) for v in value.values())
    if isinstance(value, list):
        return any(_any_enabled(v, switch) for v in value)
    return False


def _check_sub_keys(key: str, value: Mapping[str, Any], default: Mapping[str, Any]) -> None:
    check_keys(key, value, default)


_REMOVED = "DeepSpeed 0.19 removed it too (https://github.com/deepspeedai/DeepSpeed/issues/8489)."

# DeepSpeed 0.19's top-level keys for features ds does not implement, with DeepSpeed's defaults
# (read from deepspeed/runtime/config.py and the section config models).
NOT_IMPLEMENTED: dict[str, NotImplementedFeature] = {
    "autotuning": NotImplementedFeature(
        "the autotuner",
        {
            "enabled": False,
            "start_step": None,
            "end_step": None,
            "metric_path": None,
            "arg_mappings": None,
            "metric": "throughput",
            "model_info": None,
            "results_dir": "autotuning_results",
            "exps_dir": "autotuning_exps",
            "overwrite": True,
            "fast": True,
            "start_profile_step": 3,
            "end_profile_step": 5,
            "tuner_type": "gridsearch",
            "tuner_early_stopping": 5,
            "tuner_num_trials": 50,
            "model_info_path": None,
            "mp_size": 1,
            "max_train_batch_size": None,
            "min_train_batch_size": 1,
            "max_train_micro_batch_size_per_gpu": 1024,
            "min_train_micro_batch_size_per_gpu": 1,
            "num_tuning_micro_batch_sizes": 3,
        },
        implemented_by="ds_engine.autotuning",
    ),
    "hybrid_engine": NotImplementedFeature(
        "the hybrid (RLHF training + inference) engine",
        {
            "enabled": False,
            "max_out_tokens": 512,
            "inference_tp_size": 1,
            "release_inference_cache": False,
            "pin_parameters": True,
            "tp_gather_partition_size": 8,
            "enable_cuda_graph": False,
        },
    ),
    "torch_autocast": NotImplementedFeature(
        "torch.autocast mixed precision inside the engine",
        {
            "enabled": False,
            "dtype": None,
            "lower_precision_safe_modules": [
                "torch.nn.modules.linear.Linear",
                "torch.nn.modules.conv.Conv1d",
                "torch.nn.modules.conv.Conv2d",
                "torch.nn.modules.conv.Conv3d",
            ],
        },
        note='Use "bf16" or "fp16" instead.',
    ),
    "tensor_parallel": NotImplementedFeature(
        "AutoTP settings beyond autotp_size and dtype",
        {
            "autotp_size": 0,
            "tp_overlap_comm": False,
            "vocab_parallel_lm_head": None,
            "vocab_parallel_ce_backend": "torch",
            "tensor_parallel": {"tp_size": 1, "tp_grain_size": 1},
            "injection_policy_tuple": None,
            "partition_config": None,
            "preset_model": None,
            "keep_module_on_host": False,
            "replace_with_kernel_inject": False,
            "dtype": "torch.float16",
        },
        # autotp_size and dtype: ds_engine._autotp_engine (docs/tensor_parallel.md).
        implemented_keys=("autotp_size", "dtype"),
        note="autotp_size (AutoTP training) is implemented; see docs/tensor_parallel.md.",
    ),
    "expert_parallel": NotImplementedFeature(
        "automatic expert parallelism (AutoEP)",
        {"enabled": False},
        open=True,
        note="ds_engine.moe.MoE layers give expert parallelism.",
    ),
    "seq_parallel_communication_data_type": NotImplementedFeature(
        "sequence-parallel communication in another dtype", "fp32"
    ),
    "use_data_before_expert_parallelism": NotImplementedFeature(
        "the data-before-expert process-group topology", False
    ),
    "gradient_allreduce_op": NotImplementedFeature(
        'summed (not averaged) gradients, gradient_allreduce_op "sum"', "mean"
    ),
    "managed_gradient_accumulation": NotImplementedFeature(
        "client-managed gradient accumulation boundaries", True
    ),
    "disable_allgather": NotImplementedFeature("broadcast instead of all-gather updates", False),
    "disable_python_gc": NotImplementedFeature("managed Python garbage collection", False),
    "vocabulary_size": NotImplementedFeature("vocabulary-size padding", None),
    "weight_quantization": NotImplementedFeature(
        "post-training weight quantization", {"enabled": False}, open=True
    ),
    "compile": NotImplementedFeature(
        "DeepCompile",
        {"deepcompile": False},
        open=True,
        switch="deepcompile",
        note="engine.compile() (torch.compile) is separate from this section.",
    ),
    "datastates_ckpt": NotImplementedFeature(
        "DataStates asynchronous checkpointing", {"enabled": False}, open=True
    ),
    "elasticity": NotImplementedFeature(
        "elastic training", {"enabled": False}, open=True, note=_REMOVED
    ),
    "compression_training": NotImplementedFeature(
        "compression training (quantization, pruning, layer reduction)",
        {},
        open=True,
        note=_REMOVED,
    ),
    "quantize_training": NotImplementedFeature(
        "Mixture-of-Quantization training", {"enabled": False}, open=True, note=_REMOVED
    ),
    "eigenvalue": NotImplementedFeature(
        "eigenvalue-based quantization", {"enabled": False}, open=True, note=_REMOVED
    ),
    "nebula": NotImplementedFeature(
        "Nebula checkpointing", {"enabled": False}, open=True, note=_REMOVED
    ),
    "amp": NotImplementedFeature(
        "NVIDIA Apex AMP", {"enabled": False}, open=True, note='Use "bf16" or "fp16". ' + _REMOVED
    ),
    "sparse_attention": NotImplementedFeature(
        "DeepSpeed sparse attention", {}, open=True, switched=False, note=_REMOVED
    ),
    "sparse_gradients": NotImplementedFeature(
        "sparse compression of dense embedding gradients", False, note=_REMOVED
    ),
    "graph_harvesting": NotImplementedFeature("CUDA graph harvesting", False, note=_REMOVED),
    "pipeline": NotImplementedFeature(
        "pipeline settings from the config (pass them to PipelineModule)",
        {
            "stages": "auto",
            "partition": "best",
            "seed_layers": False,
            "activation_checkpoint_interval": 0,
            "pipe_partitioned": True,
            "grad_partitioned": True,
            "use_reentrant": None,
        },
        # Both partitioning switches act only with tensor parallelism (none in ds); ds_pipe
        # checkpoints non-reentrantly.
        inert={
            "pipe_partitioned": (False,),
            "grad_partitioned": (False,),
            "use_reentrant": (False,),
        },
    ),
}


class FeatureSettings(Section):
    """Every row of :data:`NOT_IMPLEMENTED` at the value the config gave (all asking for
    nothing), read as attributes: ``settings.flops_profiler.module_depth``."""

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        config = config or {}
        values: dict[str, Any] = {}
        for key, row in NOT_IMPLEMENTED.items():
            value = config.get(key)
            if row.requested(key, value) and not row.implemented_by:
                raise row.refusal(key, value)
            values[key] = row.settings(value)
        super().__init__(values)

    def __repr__(self) -> str:
        return f"FeatureSettings({sorted(self._values)})"
