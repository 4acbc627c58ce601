"""build_optimizer and register_optimizer: DeepSpeed's optimizer section to an optimizer, the Adam
type's adam_w_mode/torch_adam/offload rules, errors for unknown types and params, OptimizerConfig."""

from __future__ import annotations

import importlib

import pytest
import torch

import ds_optim
from ds_optim import _registry
from ds_optim.api import ConfigError, OptimizerConfig


def _params() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 3, generator=gen)), torch.nn.Parameter(torch.ones(3))]


def _assert_steps_like_torch_adam(opt: torch.optim.Optimizer, decoupled: bool) -> None:
    """One step of ``opt`` (built with lr=0.1, weight_decay=0.5) equals torch's AdamW or Adam."""
    theirs = _params()
    ref = (torch.optim.AdamW if decoupled else torch.optim.Adam)(theirs, lr=0.1, weight_decay=0.5)
    for ps in (opt.param_groups[0]["params"], theirs):
        for p in ps:
            p.grad = torch.full_like(p, 0.25)
    opt.step()
    ref.step()
    torch.testing.assert_close(opt.param_groups[0]["params"], theirs, rtol=1e-6, atol=1e-7)


@pytest.fixture
def registry():
    """The registry, restored after the test (it is process-wide)."""
    saved = dict(_registry._REGISTRY)
    yield _registry._REGISTRY
    _registry._REGISTRY.clear()
    _registry._REGISTRY.update(saved)


@pytest.mark.parametrize(
    ("type_name", "cls"),
    [
        ("Adam", ds_optim.FusedAdam),
        ("adamw", ds_optim.FusedAdam),
        ("LAMB", ds_optim.FusedLamb),
        ("Lion", ds_optim.Lion),
        ("adagrad", ds_optim.Adagrad),
        ("SGD", torch.optim.SGD),
        ("rmsprop", torch.optim.RMSprop),  # any torch.optim class, as in DeepSpeed
    ],
)
def test_types_build_their_optimizer_case_insensitively(type_name: str, cls: type) -> None:
    opt = ds_optim.build_optimizer({"type": type_name, "params": {"lr": 0.5}}, _params())
    assert type(opt) is cls
    assert opt.param_groups[0]["lr"] == 0.5


@pytest.mark.parametrize(
    ("type_name", "params", "decoupled"),
    [
        ("Adam", {}, True),  # DeepSpeed's trap: "Adam" means AdamW unless told otherwise
        ("Adam", {"adam_w_mode": False}, False),
        ("AdamW", {"adam_w_mode": False}, True),  # AdamW is always decoupled
        ("adam", {"adam_w_mode": True}, True),
    ],
)
def test_adam_weight_decay_mode_follows_deepspeed(
    type_name: str, params: dict, decoupled: bool
) -> None:
    section = {"type": type_name, "params": {"lr": 0.1, "weight_decay": 0.5, **params}}
    opt = ds_optim.build_optimizer(section, _params())
    assert opt.param_groups[0]["adam_w_mode"] is decoupled
    _assert_steps_like_torch_adam(opt, decoupled)


@pytest.mark.parametrize(
    ("type_name", "adam_w_mode", "cls"),
    [("Adam", False, torch.optim.Adam), ("Adam", True, torch.optim.AdamW)],
)
def test_torch_adam_builds_torchs_optimizer(type_name: str, adam_w_mode: bool, cls: type) -> None:
    section = {"type": type_name, "params": {"torch_adam": True, "adam_w_mode": adam_w_mode}}
    opt = ds_optim.build_optimizer(section, _params())
    assert type(opt) is cls


def test_torch_adam_accepts_torchs_own_params() -> None:
    section = {"type": "Adam", "params": {"torch_adam": True, "amsgrad": True, "foreach": False}}
    assert ds_optim.build_optimizer(section, _params()).param_groups[0]["amsgrad"] is True


@pytest.mark.parametrize(
    ("type_name", "params", "decoupled"),
    [("Adam", {}, True), ("Adam", {"adam_w_mode": False}, False), ("AdamW", {}, True)],
)
def test_offload_builds_cpu_adam(type_name: str, params: dict, decoupled: bool) -> None:
    from ds_optim._cpu_adam import CPUAdam

    section = {"type": type_name, "params": {"lr": 0.1, "weight_decay": 0.5, **params}}
    opt = ds_optim.build_optimizer(section, _params(), offload=True)
    assert type(opt) is CPUAdam
    _assert_steps_like_torch_adam(opt, decoupled)


def test_offload_leaves_other_types_alone() -> None:
    opt = ds_optim.build_optimizer({"type": "Lion"}, _params(), offload=True)
    assert type(opt) is ds_optim.Lion


def test_betas_from_json_lists_are_accepted() -> None:
    section = {"type": "Lamb", "params": {"betas": [0.8, 0.9], "max_coeff": 0.3}}
    opt = ds_optim.build_optimizer(section, _params())
    assert opt.param_groups[0]["betas"] == (0.8, 0.9)


def test_param_groups_pass_through() -> None:
    params = _params()
    groups = [{"params": params[:1]}, {"params": params[1:], "lr": 0.01}]
    opt = ds_optim.build_optimizer({"type": "AdamW", "params": {"lr": 0.1}}, groups)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.01]


def test_unknown_type_lists_the_known_types() -> None:
    with pytest.raises(ConfigError) as info:
        ds_optim.build_optimizer({"type": "Adamax2"}, _params())
    message = str(info.value)
    assert "optimizer.type = 'Adamax2' is not a known optimizer" in message
    for name in ("Adam", "AdamW", "Lamb", "OneBitAdam", "ZeroOneAdam", "OneBitLamb", "Lion"):
        assert name in message
    assert "torch.optim class name" in message


def test_muon_is_refused_as_not_implemented(registry) -> None:
    # torch.optim.Muon would be picked by name otherwise, and fails on ZeRO's flat partitions.
    section = {"type": "Muon", "params": {"lr": 1e-3, "muon_lr": 1e-3, "ns_method": "gram"}}
    with pytest.raises(ConfigError, match=r"optimizer.type = 'Muon' .*not implemented in ds"):
        OptimizerConfig.from_dict(section)
    ds_optim.register_optimizer("Muon", torch.optim.SGD)  # a registered type still wins
    assert isinstance(ds_optim.build_optimizer({"type": "muon"}, _params()), torch.optim.SGD)


def test_unknown_type_suggests_a_close_one() -> None:
    with pytest.raises(ConfigError, match="did you mean 'OneBitAdam'"):
        ds_optim.build_optimizer({"type": "OnebitAdm"}, _params())


def test_unknown_param_names_it_the_type_and_the_accepted_names() -> None:
    with pytest.raises(ConfigError) as info:
        ds_optim.build_optimizer({"type": "Lamb", "params": {"weight_decy": 0.1}}, _params())
    message = str(info.value)
    assert "optimizer.params.weight_decy is not a parameter of optimizer type 'Lamb'" in message
    assert "did you mean 'weight_decay'?" in message
    assert "max_coeff" in message and "eps_inside_sqrt" in message


def test_params_of_torch_adam_are_unknown_to_fused_adam() -> None:
    with pytest.raises(ConfigError, match=r"optimizer\.params\.foreach is not a parameter of"):
        ds_optim.build_optimizer({"type": "Adam", "params": {"foreach": True}}, _params())


def test_max_grad_norm_points_to_gradient_clipping() -> None:
    with pytest.raises(
        ConfigError, match=r"max_grad_norm is not supported for type 'Lamb'.*clipping"
    ):
        ds_optim.build_optimizer({"type": "Lamb", "params": {"max_grad_norm": 1.0}}, _params())


def test_bad_values_are_config_errors_naming_the_type() -> None:
    with pytest.raises(ConfigError, match=r"optimizer \(type 'Adam'\): FusedAdam: amsgrad=True"):
        ds_optim.build_optimizer({"type": "Adam", "params": {"amsgrad": True}}, _params())
    with pytest.raises(ConfigError, match=r"optimizer\.params\.torch_adam = 'yes': expected true"):
        ds_optim.build_optimizer({"type": "Adam", "params": {"torch_adam": "yes"}}, _params())


def test_register_optimizer_adds_a_type(registry) -> None:
    def my_sgd(params, lr: float = 0.1, momentum: float = 0.0) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=lr, momentum=momentum)

    ds_optim.register_optimizer("MySGD", my_sgd)
    opt = ds_optim.build_optimizer({"type": "mysgd", "params": {"momentum": 0.9}}, _params())
    assert opt.param_groups[0]["momentum"] == 0.9
    assert "MySGD" in _registry.known_optimizer_types()
    with pytest.raises(ConfigError, match=r"nesterov is not a parameter of optimizer type 'MySGD'"):
        ds_optim.build_optimizer({"type": "MySGD", "params": {"nesterov": True}}, _params())


def test_register_optimizer_refuses_to_replace_silently(registry) -> None:
    with pytest.raises(ValueError, match="'Lion' is already registered; pass replace=True"):
        ds_optim.register_optimizer("lion", torch.optim.SGD)
    ds_optim.register_optimizer("lion", torch.optim.SGD, replace=True)
    assert type(ds_optim.build_optimizer({"type": "Lion"}, _params())) is torch.optim.SGD


def test_factory_with_kwargs_accepts_any_param(registry) -> None:
    seen = {}

    def factory(params, **kwargs):
        seen.update(kwargs)
        return torch.optim.SGD(params, lr=0.1)

    ds_optim.register_optimizer("anything", factory)
    ds_optim.build_optimizer({"type": "anything", "params": {"x": 1, "y": "z"}}, _params())
    assert seen == {"x": 1, "y": "z"}


@pytest.mark.parametrize(
    ("name", "factory", "error"),
    [("", torch.optim.SGD, ValueError), ("x", "not callable", TypeError)],
)
def test_register_optimizer_checks_its_arguments(name, factory, error, registry) -> None:
    with pytest.raises(error):
        ds_optim.register_optimizer(name, factory)


def test_optimizer_config_from_dict_checks_keys_and_names() -> None:
    config = OptimizerConfig.from_dict({"type": "adamw", "params": {"lr": 1e-3}})
    assert (config.type, dict(config.params)) == ("AdamW", {"lr": 1e-3})
    assert OptimizerConfig.from_dict({"type": "Lion", "params": None}).params == {}
    with pytest.raises(
        ConfigError, match=r"optimizer.parms is not a known key; did you mean 'params'"
    ):
        OptimizerConfig.from_dict({"type": "Adam", "parms": {}})
    with pytest.raises(ConfigError, match=r"optimizer\.type is missing"):
        OptimizerConfig.from_dict({"params": {}})
    with pytest.raises(ConfigError, match=r"optimizer\.params\.betas1 is not a parameter"):
        OptimizerConfig(type="Adam", params={"betas1": 0.9})


def test_optimizer_config_builds() -> None:
    config = OptimizerConfig(type="Adagrad", params={"lr": 0.3})
    opt = ds_optim.build_optimizer(config, _params())
    assert type(opt) is ds_optim.Adagrad and opt.param_groups[0]["lr"] == 0.3


ONE_BIT = [
    ("OneBitAdam", "ds_optim._onebit_adam", {"freeze_step": 2, "lr": 1e-3}),
    ("ZeroOneAdam", "ds_optim._zero_one_adam", {"var_freeze_step": 4, "lr": 1e-3}),
    ("OneBitLamb", "ds_optim._onebit_lamb", {"freeze_step": 2, "max_coeff": 0.3}),
]


@pytest.mark.parametrize(("type_name", "module", "params"), ONE_BIT, ids=[t[0] for t in ONE_BIT])
def test_one_bit_types_build_with_their_own_params(type_name, module, params) -> None:
    cls = getattr(importlib.import_module(module), type_name)
    opt = ds_optim.build_optimizer({"type": type_name.lower(), "params": params}, _params())
    assert type(opt) is cls
    for key, value in params.items():  # a group hyperparameter or an optimizer attribute
        assert opt.param_groups[0].get(key, getattr(opt, key, None)) == value
    # They reduce their own gradients, so they clip them too: max_grad_norm is theirs.
    section = {"type": type_name, "params": {"max_grad_norm": 1.0}}
    assert ds_optim.build_optimizer(section, _params()).param_groups[0]["max_grad_norm"] == 1.0
    with pytest.raises(
        ConfigError, match=f"freez_step is not a parameter of optimizer type '{type_name}'"
    ):
        ds_optim.build_optimizer({"type": type_name, "params": {"freez_step": 1}}, _params())


def _group_is_forwarded_body(rank: int, world_size: int) -> bool:
    import ds_comm

    group = ds_comm.new_group(list(range(world_size)))
    params = [torch.nn.Parameter(torch.zeros(4))]
    onebit = ds_optim.build_optimizer({"type": "OneBitAdam"}, params, group=group)
    adam = ds_optim.build_optimizer({"type": "Adam"}, params, group=group)  # group ignored
    return onebit.process_group is group and isinstance(adam, ds_optim.FusedAdam)


def test_group_reaches_optimizers_that_reduce_their_own_gradients() -> None:
    from ds_testing import run_on_ranks

    assert run_on_ranks(_group_is_forwarded_body, 2) == [True, True]
