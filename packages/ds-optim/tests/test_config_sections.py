"""ds-optim's config sections: "auto" placeholders, refused switches, unresolved params."""

from __future__ import annotations

import pytest

from ds_optim import BF16Config, FP16Config, OptimizerConfig, SchedulerConfig
from ds_optim.api import ConfigError


def test_auto_is_deepspeeds_default_in_precision_sections() -> None:
    assert FP16Config.from_dict({"enabled": "auto", "loss_scale": 0}) == FP16Config()
    assert BF16Config.from_dict({"enabled": "auto"}) == BF16Config()
    assert FP16Config.from_dict({"enabled": True, "initial_scale_power": "auto"}).enabled


@pytest.mark.parametrize(
    ("cls", "key"),
    [
        (FP16Config, "fp16_master_weights_and_grads"),
        (BF16Config, "immediate_grad_update"),
        (BF16Config, "check_grad_overflow"),
        (BF16Config, "bf16_master_weights_and_grads"),
    ],
)
def test_switches_ds_does_not_implement_are_refused_when_true(cls, key: str) -> None:
    assert getattr(cls.from_dict({key: False}), key) is False
    with pytest.raises(ConfigError, match=f"{key} = true asks for .*not implemented in ds"):
        cls.from_dict({"enabled": True, key: True})


def test_optimizer_params_may_be_auto_until_built() -> None:
    section = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.01}}
    cfg = OptimizerConfig.from_dict(section)
    assert cfg.params == {"lr": "auto", "weight_decay": 0.01}
    with pytest.raises(ConfigError, match=r"optimizer\.params\.lr = \"auto\""):
        cfg.resolved_params()
    resolved = OptimizerConfig.from_dict({"type": "AdamW", "params": {"lr": 1e-3}})
    assert resolved.resolved_params() == {"lr": 1e-3}


def test_scheduler_params_may_be_auto_until_built() -> None:
    cfg = SchedulerConfig.from_dict({"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}})
    with pytest.raises(ConfigError, match=r"scheduler\.params\.warmup_num_steps"):
        cfg.resolved_params()


def test_optimizer_legacy_fusion_key() -> None:
    assert not OptimizerConfig.from_dict({"type": "Adam", "legacy_fusion": False}).legacy_fusion
    with pytest.raises(ConfigError, match=r"legacy_fusion = true.*not implemented in ds"):
        OptimizerConfig.from_dict({"type": "Adam", "legacy_fusion": True})
    with pytest.raises(ConfigError, match="did you mean 'legacy_fusion'"):
        OptimizerConfig.from_dict({"type": "Adam", "legacy_fuson": False})
