"""axpy: the C kernel against the torch reference, the dispatch rule, and argument errors."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

import ds_native
from ds_native import _ext
from ds_native._ext import NativeExtension


class _RecordingLib:
    """Wraps the cffi lib to count calls into C."""

    def __init__(self, lib: object) -> None:
        self._lib = lib
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> object:
        self.calls.append(name)
        return getattr(self._lib, name)


@pytest.fixture
def recording_lib(monkeypatch: pytest.MonkeyPatch) -> _RecordingLib:
    assert _ext.EXTENSION.lib is not None, _ext.EXTENSION.unavailable_reason
    lib = _RecordingLib(_ext.EXTENSION.lib)
    monkeypatch.setattr(_ext, "EXTENSION", NativeExtension(ffi=_ext.EXTENSION.ffi, lib=lib))
    return lib


@pytest.fixture
def no_extension(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    reason = "C extension not built (test)"
    monkeypatch.setattr(_ext, "EXTENSION", NativeExtension(unavailable_reason=reason))
    _ext.warn_fallback.cache_clear()
    yield reason
    _ext.warn_fallback.cache_clear()


@pytest.mark.parametrize("n", [0, 1, 7, 1023, 4097, 1_000_003])
@pytest.mark.parametrize("alpha", [0.0, 1.0, -2.5, 1e-3, 3])
def test_native_matches_reference(n: int, alpha: float) -> None:
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen)
    y = torch.randn(n, generator=gen)
    expected = ds_native.axpy_reference(alpha, x, y.clone())

    out = ds_native.axpy(alpha, x, y, backend="native")

    assert out is y
    torch.testing.assert_close(y, expected)


def test_native_on_multidimensional_tensor() -> None:
    x, y = torch.randn(3, 5, 7), torch.randn(3, 5, 7)
    expected = ds_native.axpy_reference(0.5, x, y.clone())
    torch.testing.assert_close(ds_native.axpy(0.5, x, y, backend="native"), expected)


def test_native_with_x_aliasing_y() -> None:
    y = torch.randn(1001)
    expected = y * 3
    ds_native.axpy(2.0, y, y, backend="native")
    torch.testing.assert_close(y, expected)


def test_default_picks_native_for_contiguous_float32_cpu(recording_lib: _RecordingLib) -> None:
    ds_native.axpy(1.0, torch.ones(4), torch.ones(4))
    assert recording_lib.calls == ["ds_native_axpy_f32"]


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: (torch.ones(4, 6)[:, ::2], torch.ones(4, 3)), id="non-contiguous-x"),
        pytest.param(lambda: (torch.ones(4, 3), torch.ones(3, 4).t()), id="non-contiguous-y"),
        *(
            pytest.param(lambda d=d: (torch.ones(5, dtype=d), torch.ones(5, dtype=d)), id=str(d))
            for d in (torch.float64, torch.float16, torch.bfloat16)
        ),
    ],
)
def test_default_falls_back_to_reference(
    recording_lib: _RecordingLib, make: Callable[[], tuple[torch.Tensor, torch.Tensor]]
) -> None:
    x, y = make()
    expected = ds_native.axpy_reference(0.5, x, y.clone())

    out = ds_native.axpy(0.5, x, y)

    assert recording_lib.calls == []
    assert out is y
    torch.testing.assert_close(y, expected)


def test_default_falls_back_off_cpu(recording_lib: _RecordingLib) -> None:
    y = torch.empty(8, device="meta")
    assert ds_native.axpy(2.0, torch.empty(8, device="meta"), y) is y
    assert recording_lib.calls == []


@pytest.mark.gpu(1)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_default_falls_back_on_cuda(recording_lib: _RecordingLib) -> None:
    x, y = torch.randn(100, device="cuda"), torch.randn(100, device="cuda")
    expected = ds_native.axpy_reference(2.0, x, y.clone())
    torch.testing.assert_close(ds_native.axpy(2.0, x, y), expected)
    assert recording_lib.calls == []


def test_autograd_goes_through_reference(recording_lib: _RecordingLib) -> None:
    x = torch.ones(4, requires_grad=True)
    y = torch.zeros(4)
    ds_native.axpy(3.0, x, y).sum().backward()
    assert recording_lib.calls == []
    torch.testing.assert_close(x.grad, torch.full((4,), 3.0))

    with torch.no_grad():
        ds_native.axpy(3.0, x, y)
    assert recording_lib.calls == ["ds_native_axpy_f32"]


def test_native_bumps_version_counter() -> None:
    y = torch.zeros(4)
    version = y._version
    ds_native.axpy(1.0, torch.ones(4), y, backend="native")
    assert y._version > version


def test_partial_overlap_raises_like_torch() -> None:
    buf = torch.arange(10.0)
    with pytest.raises(RuntimeError, match="single memory location"):
        ds_native.axpy(1.0, buf[0:5], buf[1:6])


def test_missing_extension_warns_once_and_uses_reference(no_extension: str) -> None:
    x, y = torch.ones(5), torch.ones(5)
    with pytest.warns(ds_native.NativeFallbackWarning, match="not built \\(test\\)") as record:
        ds_native.axpy(2.0, x, y)
        ds_native.axpy(2.0, x, y)
    assert len(record) == 1
    assert record[0].filename == __file__  # stacklevel points at the caller
    torch.testing.assert_close(y, torch.full((5,), 5.0))


def test_missing_extension_does_not_warn_when_native_would_not_run(
    no_extension: str, recwarn: pytest.WarningsRecorder
) -> None:
    ds_native.axpy(2.0, torch.ones(5, dtype=torch.float64), torch.ones(5, dtype=torch.float64))
    ds_native.axpy(2.0, torch.ones(5), torch.ones(5), backend="torch")
    assert not [w for w in recwarn if issubclass(w.category, ds_native.NativeFallbackWarning)]


def test_forced_native_without_extension_raises_with_reason(no_extension: str) -> None:
    with pytest.raises(RuntimeError, match="axpy\\(backend='native'\\): C extension not built"):
        ds_native.axpy(2.0, torch.ones(5), torch.ones(5), backend="native")


@pytest.mark.parametrize(
    ("x", "y", "match"),
    [
        (torch.ones(4), torch.ones(4, 1), r"same shape, got x.shape=\(4,\) and y.shape=\(4, 1\)"),
        (torch.ones(2, 3), torch.ones(3, 2), r"x.shape=\(2, 3\) and y.shape=\(3, 2\)"),
        (torch.ones(4), torch.empty(4, device="meta"), "same device, got cpu and meta"),
    ],
)
def test_value_errors(x: torch.Tensor, y: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ds_native.axpy(1.0, x, y)


def test_dtype_mismatch_raises() -> None:
    with pytest.raises(TypeError, match=r"same dtype, got torch\.float64 and torch\.float32"):
        ds_native.axpy(1.0, torch.ones(4, dtype=torch.float64), torch.ones(4))


@pytest.mark.parametrize("alpha", [torch.tensor(1.0), "1.0", True, None])
def test_alpha_must_be_a_real_number(alpha: object) -> None:
    with pytest.raises(TypeError, match="alpha must be a real number"):
        ds_native.axpy(alpha, torch.ones(4), torch.ones(4))  # type: ignore[arg-type]


def test_forced_native_names_what_it_cannot_take() -> None:
    with pytest.raises(ValueError, match="C kernel needs contiguous tensors"):
        ds_native.axpy(1.0, torch.ones(4, 2)[:, 0], torch.ones(4), backend="native")
    with pytest.raises(ValueError, match=r"needs torch\.float32 tensors, got torch\.float64"):
        x = torch.ones(4, dtype=torch.float64)
        ds_native.axpy(1.0, x, x.clone(), backend="native")


def test_unknown_backend_raises() -> None:
    with pytest.raises(ValueError, match="backend must be 'native', 'torch' or None, got 'cuda'"):
        ds_native.axpy(1.0, torch.ones(4), torch.ones(4), backend="cuda")  # type: ignore[arg-type]
