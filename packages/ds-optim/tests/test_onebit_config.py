"""Arguments: DeepSpeed's names and defaults, clear errors that name the key, the value and the
fix, the ``reduces_gradients`` contract, and what the optimizers refuse at step time."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

import ds_optim
from ds_optim.api import ConfigError

_CLASSES = [ds_optim.OneBitAdam, ds_optim.ZeroOneAdam, ds_optim.OneBitLamb]


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]


@pytest.mark.parametrize("cls", _CLASSES, ids=lambda c: c.__name__)
def test_declares_that_it_reduces_its_own_gradients(cls: type) -> None:
    assert cls.reduces_gradients is True
    assert cls(_params()).reduces_gradients is True
    assert isinstance(cls(_params()), torch.optim.Optimizer)


def test_deepspeed_defaults() -> None:
    def defaults(cls: type) -> dict[str, Any]:
        signature = inspect.signature(cls.__init__)
        return {name: p.default for name, p in signature.parameters.items() if name != "self"}

    common = {
        "group": None,
        "lr": 1e-3,
        "bias_correction": True,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "eps_inside_sqrt": False,
        "weight_decay": 0.0,
        "max_grad_norm": 0.0,
        "amsgrad": False,
        "cuda_aware": False,
        "comm_backend_name": "nccl",
    }
    assert defaults(ds_optim.OneBitAdam).items() >= {**common, "freeze_step": 100000}.items()
    zero_one = {
        "var_freeze_step": 100000,
        "var_update_scaler": 16,
        "local_step_scaler": 32678,
        "local_step_clipper": 16,
    }
    assert defaults(ds_optim.ZeroOneAdam).items() >= {**common, **zero_one}.items()
    lamb = {
        "freeze_step": 100000,
        "max_coeff": 10.0,
        "min_coeff": 0.01,
        "coeff_beta": 0.9,
        "factor_max": 4.0,
        "factor_min": 0.5,
        "factor_threshold": 0.1,
    }
    assert defaults(ds_optim.OneBitLamb).items() >= {**common, **lamb}.items()


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (ds_optim.OneBitAdam, {"amsgrad": True}, "amsgrad=True: the AMSGrad variant"),
        (ds_optim.ZeroOneAdam, {"amsgrad": True}, "set amsgrad to false"),
        (ds_optim.OneBitLamb, {"amsgrad": True}, "amsgrad=True"),
        (ds_optim.OneBitAdam, {"freeze_step": 0}, r"freeze_step=0: expected an integer >= 1"),
        (ds_optim.OneBitLamb, {"freeze_step": 2.5}, r"freeze_step=2.5: expected an integer"),
        (ds_optim.ZeroOneAdam, {"var_freeze_step": 0}, "var_freeze_step=0"),
        (ds_optim.ZeroOneAdam, {"var_update_scaler": 0}, "var_update_scaler=0"),
        (ds_optim.ZeroOneAdam, {"local_step_scaler": -1}, "local_step_scaler=-1"),
        (ds_optim.ZeroOneAdam, {"local_step_clipper": True}, "local_step_clipper=True"),
        (ds_optim.OneBitAdam, {"lr": -1.0}, r"OneBitAdam: lr=-1.0: expected a number >= 0"),
        (ds_optim.OneBitAdam, {"eps": float("nan")}, "eps=nan"),
        (ds_optim.ZeroOneAdam, {"weight_decay": -0.1}, "weight_decay=-0.1"),
        (ds_optim.OneBitLamb, {"max_grad_norm": -1}, "0 disables clipping"),
        (ds_optim.OneBitAdam, {"betas": (0.9,)}, r"betas=\(0.9,\): expected two numbers"),
        (ds_optim.OneBitAdam, {"betas": (0.9, 1.0)}, r"betas\[1\]=1.0: expected a number"),
        (ds_optim.OneBitAdam, {"bias_correction": 1}, "bias_correction=1: expected true"),
        (ds_optim.OneBitAdam, {"comm_backend_name": "tcp"}, "comm_backend_name='tcp'"),
        (ds_optim.OneBitLamb, {"cuda_aware": "yes"}, "cuda_aware='yes': expected true or false"),
        (ds_optim.OneBitAdam, {"eps_inside_sqrt": None}, "eps_inside_sqrt=None"),
        (ds_optim.OneBitLamb, {"min_coeff": 2.0, "max_coeff": 1.0}, "min_coeff <= max_coeff"),
        (ds_optim.OneBitLamb, {"max_coeff": -1.0}, "max_coeff=-1.0"),
        (ds_optim.OneBitLamb, {"coeff_beta": 1.0}, "coeff_beta=1.0"),
        (ds_optim.OneBitLamb, {"factor_min": 0.0}, r"factor_min=0.0: .*\(> 0\)"),
        (ds_optim.OneBitLamb, {"factor_max": 0.4}, r"factor_max=0.4: .*\(>= factor_min\)"),
        (ds_optim.OneBitLamb, {"factor_threshold": 1.5}, "factor_threshold=1.5"),
    ],
)
def test_bad_arguments_name_key_value_and_fix(
    cls: type, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        cls(_params(), **kwargs)
    assert issubclass(ConfigError, ValueError)


def test_param_group_overrides_are_checked_too() -> None:
    with pytest.raises(ConfigError, match=r"OneBitLamb: min_coeff=0\.5 > max_coeff=0\.1"):
        ds_optim.OneBitLamb([{"params": _params(), "min_coeff": 0.5, "max_coeff": 0.1}])
    optimizer = ds_optim.OneBitAdam(_params())
    with pytest.raises(ConfigError, match=r"lr=-0\.5"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], "lr": -0.5})


@pytest.mark.parametrize("backend", ["nccl", "mpi", "hccl", "compressed", "gloo"])
def test_accepts_deepspeed_backend_names(backend: str) -> None:
    optimizer = ds_optim.OneBitAdam(_params(), comm_backend_name=backend, cuda_aware=True)
    assert optimizer.comm_backend_name == backend and optimizer.world_size == 1


def test_exp_avg_mask_must_be_a_tensor_of_the_group_size() -> None:
    with pytest.raises(ConfigError, match="exp_avg_mask=list: expected a tensor"):
        ds_optim.OneBitAdam([{"params": _params(), "exp_avg_mask": [1, 0]}])
    params = _params()
    optimizer = ds_optim.OneBitAdam(
        [{"params": params, "exp_avg_mask": torch.ones(5)}], freeze_step=1
    )
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()  # warmup: the mask is not used yet
    with pytest.raises(ValueError, match=r"exp_avg_mask has 5 elements .* have 15"):
        optimizer.step()


def test_mask_zeroes_masked_momentum() -> None:
    params = [torch.nn.Parameter(torch.zeros(4))]
    mask = torch.tensor([1.0, 0.0, 1.0, 0.0])
    optimizer = ds_optim.OneBitAdam([{"params": params, "exp_avg_mask": mask}], freeze_step=2)
    for _ in range(3):
        params[0].grad = torch.ones(4)
        optimizer.step()
    momentum = optimizer.state[params[0]]["exp_avg"]
    assert torch.equal(momentum == 0, mask == 0)


def test_sparse_gradients_are_refused() -> None:
    embedding = torch.nn.Embedding(10, 3, sparse=True)
    optimizer = ds_optim.OneBitAdam(embedding.parameters())
    embedding(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        optimizer.step()


def test_group_without_process_group_is_an_error() -> None:
    with pytest.raises(ConfigError, match="no default process group"):
        ds_optim.ZeroOneAdam(_params(), group=object())  # type: ignore[arg-type]


def test_missing_grads_count_as_zero_and_empty_params_are_skipped() -> None:
    used, unused = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    empty = torch.nn.Parameter(torch.ones(0))
    optimizer = ds_optim.OneBitAdam([used, unused, empty], lr=0.1)
    used.grad = torch.ones(3)
    optimizer.step()
    assert torch.allclose(used.detach(), torch.full((3,), 0.9))
    assert torch.equal(unused.detach(), torch.ones(2))  # zero gradient, zero step
    assert empty not in optimizer.state


def test_closure_is_evaluated_with_grad_enabled() -> None:
    params = _params()
    optimizer = ds_optim.OneBitLamb(params)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = sum((p**2).sum() for p in params)
        loss.backward()
        return loss

    loss = optimizer.step(closure)
    assert loss is not None and loss.item() > 0
    assert len(optimizer.lamb_coeffs) == 2
