"""LayerSpec / TiedLayerSpec: deferred construction, validation, tied attribute lookup."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ds_pipe import LayerSpec, TiedLayerSpec
from ds_pipe._spec import get_tied_attr


def test_build_passes_args_and_kwargs_and_builds_fresh_modules() -> None:
    spec = LayerSpec(nn.Linear, 4, 3, bias=False)
    a, b = spec.build(), spec.build()
    assert isinstance(a, nn.Linear) and a.in_features == 4 and a.out_features == 3
    assert a.bias is None
    assert a is not b and a.weight.data_ptr() != b.weight.data_ptr()
    assert repr(spec) == "Linear(4, 3, bias=False)"
    assert spec.name == "Linear"


def test_build_log_names_the_layer(capsys: pytest.CaptureFixture[str]) -> None:
    LayerSpec(nn.ReLU).build(log=True)
    assert "RANK=-1 building ReLU()" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [torch.relu, nn.Linear(2, 2), int])
def test_layer_spec_rejects_non_module_classes(bad: object) -> None:
    with pytest.raises(TypeError, match=r"torch\.nn\.Module subclass"):
        LayerSpec(bad)  # type: ignore[arg-type]


def test_tied_spec_records_key_forward_fn_and_attrs() -> None:
    def fn(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return x @ module.weight.t()

    spec = TiedLayerSpec("embed", nn.Embedding, 10, 4, forward_fn=fn, padding_idx=0)
    assert spec.key == "embed" and spec.forward_fn is fn
    assert spec.tied_weight_attr == ["weight"]
    module = spec.build()
    assert module.padding_idx == 0 and module.weight.shape == (10, 4)
    assert repr(spec) == "Tied[embed]:Embedding(10, 4, padding_idx=0)"
    multi = TiedLayerSpec("k", nn.Linear, 2, 2, tied_weight_attr=("weight", "bias"))
    assert multi.tied_weight_attr == ["weight", "bias"]


def test_tied_spec_validation() -> None:
    with pytest.raises(ValueError, match="non-empty str"):
        TiedLayerSpec("", nn.Linear, 2, 2)
    with pytest.raises(ValueError, match="tied_weight_attr is empty"):
        TiedLayerSpec("k", nn.Linear, 2, 2, tied_weight_attr=[])


def test_get_tied_attr_follows_dotted_paths_and_names_missing_parts() -> None:
    model = nn.Sequential()
    model.add_module("proj", nn.Linear(2, 3))
    assert get_tied_attr(model, "proj.weight") is model.proj.weight
    with pytest.raises(AttributeError, match="has no attribute 'wieght'"):
        get_tied_attr(model, "proj.wieght")
    with pytest.raises(TypeError, match="not a parameter"):
        get_tied_attr(model, "proj")
