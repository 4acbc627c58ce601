"""adam_step's dispatch: which implementation runs, how a code path is forced, argument errors."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import ds_native
from ds_native import _adam, _ext
from ds_native._ext import NativeExtension


def _fresh(n: int = 10, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """param, grad, exp_avg, exp_avg_sq."""
    return [torch.randn(n).to(dtype), torch.randn(n).to(dtype), torch.zeros(n), torch.zeros(n)]


class _CpuWithout:
    """The loaded extension, claiming the CPU cannot run the given code path."""

    def __init__(self, lib: object, missing: int) -> None:
        self._lib = lib
        self._missing = missing

    def ds_native_adam_simd_supported(self, simd: int) -> int:
        return 0 if simd == self._missing else self._lib.ds_native_adam_simd_supported(simd)

    def __getattr__(self, name: str) -> object:
        return getattr(self._lib, name)


NOT_BUILT = "C extension not built (test)"


def _without_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    """As installed without a compiler; the fallback warning is armed again."""
    monkeypatch.setattr(_ext, "EXTENSION", NativeExtension(unavailable_reason=NOT_BUILT))
    _ext.warn_fallback.cache_clear()


def test_default_runs_the_widest_path() -> None:
    assert ds_native.adam_step(*_fresh(), step=1) == ds_native.build_info()["adam_simd"]
    assert ds_native.build_info()["adam_simd"] in ("avx512", "avx2", "scalar")


def test_simd_level_and_adam_path_agree() -> None:
    # The Adam paths are the x86 SIMD levels; elsewhere the portable path runs.
    expected = {"avx512": "avx512", "avx2": "avx2"}.get(str(ds_native.simd_level()), "scalar")
    assert ds_native.build_info()["adam_simd"] == expected


def test_env_var_forces_a_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_adam.SIMD_ENV, "scalar")
    assert ds_native.adam_step(*_fresh(), step=1) == "scalar"
    assert ds_native.build_info()["adam_simd"] == "scalar"
    # An explicit argument wins over the environment (which is then not even read).
    assert ds_native.adam_step(*_fresh(), step=1, simd="scalar") == "scalar"
    monkeypatch.setenv(_adam.SIMD_ENV, "sse9")
    assert ds_native.adam_step(*_fresh(), step=1, simd="scalar") == "scalar"


def test_bad_env_var_names_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_adam.SIMD_ENV, "sse9")
    with pytest.raises(ValueError, match=r"\$DS_NATIVE_ADAM_SIMD must be one of .* got 'sse9'"):
        ds_native.adam_step(*_fresh(), step=1)


def test_bad_simd_argument() -> None:
    with pytest.raises(ValueError, match=r"simd must be one of 'avx512', 'avx2', 'scalar'"):
        ds_native.adam_step(*_fresh(), step=1, simd="neon")  # type: ignore[arg-type]


def test_path_the_cpu_lacks_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    lib = _ext.EXTENSION.lib
    fake = _CpuWithout(lib, lib.DS_NATIVE_ADAM_AVX512)
    monkeypatch.setattr(_ext, "EXTENSION", NativeExtension(ffi=_ext.EXTENSION.ffi, lib=fake))
    with pytest.raises(ValueError, match="simd='avx512' cannot run on this CPU"):
        ds_native.adam_step(*_fresh(), step=1, simd="avx512")


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: _fresh(dtype=torch.float16), id="fp16-param"),
        pytest.param(lambda: _fresh(dtype=torch.float64), id="fp64-param"),
        pytest.param(lambda: [t[::2] for t in _fresh(20)], id="strided"),
    ],
)
def test_what_the_kernel_cannot_take_runs_the_reference(
    make: Callable[[], list[torch.Tensor]],
) -> None:
    ours = make()
    ref = [t.clone() for t in ours]
    assert ds_native.adam_step(*ours, step=2, lr=0.1) == "torch"
    ds_native.adam_step_reference(*ref, step=2, lr=0.1)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b)


def test_reference_keeps_each_tensors_dtype() -> None:
    param = torch.randn(6).to(torch.bfloat16)
    grad = torch.randn(6).to(torch.bfloat16)
    exp_avg, exp_avg_sq = torch.zeros(6), torch.zeros(6)
    expected = param.float()
    ds_native.adam_step_reference(
        expected, grad.float(), exp_avg.clone(), exp_avg_sq.clone(), step=1, lr=0.1
    )

    ds_native.adam_step(param, grad, exp_avg, exp_avg_sq, step=1, lr=0.1)

    assert param.dtype == torch.bfloat16 and exp_avg.dtype == torch.float32
    assert torch.equal(param, expected.to(torch.bfloat16))


def test_autograd_goes_through_reference() -> None:
    param = torch.randn(5, requires_grad=True)
    tensors = (torch.randn(5), torch.zeros(5), torch.zeros(5))
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        ds_native.adam_step(param, *tensors, step=1)  # torch's in-place rule on a leaf
    with torch.no_grad():
        assert ds_native.adam_step(param, *tensors, step=1) != "torch"


def test_native_bumps_version_counters() -> None:
    tensors = _fresh()
    copy = torch.empty(10, dtype=torch.bfloat16)
    before = [t._version for t in (*tensors, copy)]
    ds_native.adam_step(*tensors, step=1, param_copy=copy, backend="native")
    after = [t._version for t in (*tensors, copy)]
    assert [a > b for a, b in zip(after, before)] == [True, False, True, True, True]


def test_forced_native_names_what_it_cannot_take() -> None:
    with pytest.raises(ValueError, match=r"needs torch\.float32 tensors, got torch\.float16 for"):
        ds_native.adam_step(*_fresh(dtype=torch.float16), step=1, backend="native")
    with pytest.raises(ValueError, match="needs contiguous tensors"):
        ds_native.adam_step(*[t[::2] for t in _fresh(20)], step=1, backend="native")
    with pytest.raises(ValueError, match=r"float16, torch.float32"):
        p, g, m, v = _fresh()
        ds_native.adam_step(p, g.double(), m, v, step=1, backend="native")


def test_missing_extension_warns_once_and_uses_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    _without_extension(monkeypatch)
    ours = _fresh()
    ref = [t.clone() for t in ours]
    with pytest.warns(ds_native.NativeFallbackWarning, match="not built \\(test\\)") as record:
        assert ds_native.adam_step(*ours, step=1) == "torch"
        assert ds_native.adam_step(*ours, step=2) == "torch"
    assert len(record) == 1
    assert record[0].filename == __file__  # stacklevel points at the caller
    ds_native.adam_step_reference(*ref, step=1)
    ds_native.adam_step_reference(*ref, step=2)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b)
    assert ds_native.build_info()["adam_simd"] is None


def test_forced_native_without_extension_raises_with_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _without_extension(monkeypatch)
    with pytest.raises(RuntimeError, match=r"adam_step\(backend='native'\): C extension not"):
        ds_native.adam_step(*_fresh(), step=1, backend="native")


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda p, g, m, v: (p, g, p, v), "param and exp_avg share memory"),
        (lambda p, g, m, v: (p, g, m, m), "exp_avg and exp_avg_sq share memory"),
        (lambda p, g, m, v: (p, p, m, v), "param and grad share memory"),
    ],
)
def test_aliased_buffers_raise(make: Callable[..., tuple], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ds_native.adam_step(*make(*_fresh()), step=1)


def test_partially_overlapping_buffers_raise() -> None:
    buf = torch.zeros(30)
    p, g = torch.randn(10), torch.randn(10)
    with pytest.raises(ValueError, match="exp_avg and exp_avg_sq share memory"):
        ds_native.adam_step(p, g, buf[0:10], buf[5:15], step=1)
    with pytest.raises(ValueError, match="param and param_copy share memory"):
        ds_native.adam_step(
            p, g, buf[0:10], buf[10:20], step=1, param_copy=p.view(torch.bfloat16)[:10]
        )
    # Disjoint slices of one buffer are fine.
    ds_native.adam_step(p, g, buf[0:10], buf[10:20], step=1)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"step": 0}, ValueError, "step counts from 1, got step=0"),
        ({"step": True}, TypeError, "step must be an int, got bool"),
        ({"step": 1.0}, TypeError, "step must be an int, got float"),
        (
            {"step": 1, "param_copy": torch.empty(10)},
            TypeError,
            "param_copy must be float16 or bfloat16, got torch.float32",
        ),
        (
            {"step": 1, "param_copy": torch.empty(11, dtype=torch.bfloat16)},
            ValueError,
            r"param_copy must have param's shape \(10,\), got \(11,\)",
        ),
        ({"step": 1, "backend": "cuda"}, ValueError, "backend must be 'native', 'torch' or None"),
    ],
)
def test_argument_errors(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        ds_native.adam_step(*_fresh(), **kwargs)


def test_shape_and_device_mismatch() -> None:
    p, g, m, v = _fresh()
    with pytest.raises(ValueError, match=r"grad must have param's shape \(10,\), got \(2, 5\)"):
        ds_native.adam_step(p, g.view(2, 5), m, v, step=1)
    with pytest.raises(ValueError, match="exp_avg_sq must be on param's device cpu, got meta"):
        ds_native.adam_step(p, g, m, v.to("meta"), step=1)
