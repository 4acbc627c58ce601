"""How scaled_add chooses between Triton and the torch reference, and its argument errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import ds_kernels
from ds_kernels import _scaled_add, _triton


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Records Triton launches instead of running them."""
    calls: list[torch.Tensor] = []

    def fake_launch(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
        calls.append(x)
        return ds_kernels.scaled_add_reference(x, y, alpha)

    monkeypatch.setattr(_scaled_add, "_launch", fake_launch)
    return calls


@pytest.fixture
def no_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_triton, "triton", None)
    monkeypatch.setattr(_triton, "_IMPORT_ERROR", "No module named 'triton' (test)")


def test_cpu_tensors_get_the_reference_by_default(launches: list[torch.Tensor]) -> None:
    out = ds_kernels.scaled_add(torch.ones(8), torch.ones(8), 2.0)
    assert launches == []
    torch.testing.assert_close(out, torch.full((8,), 3.0))


def test_torch_backend_never_launches(launches: list[torch.Tensor]) -> None:
    ds_kernels.scaled_add(torch.ones(8), torch.ones(8), 2.0, backend="torch")
    assert launches == []


def test_meta_tensors_get_the_reference(launches: list[torch.Tensor]) -> None:
    x = torch.empty(8, device="meta")
    assert ds_kernels.scaled_add(x, x, 2.0).device.type == "meta"
    assert launches == []


@pytest.mark.gpu(1)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_get_triton_by_default(launches: list[torch.Tensor]) -> None:
    x = torch.ones(8, device="cuda")
    ds_kernels.scaled_add(x, x, 2.0)
    assert len(launches) == 1
    ds_kernels.scaled_add(x.double(), x.double(), 2.0)  # unsupported dtype: reference
    ds_kernels.scaled_add(torch.ones(4, 2, device="cuda")[:, 0], x[:4], 2.0)  # strided
    assert len(launches) == 1


def test_without_triton_default_uses_reference(
    no_triton: None, launches: list[torch.Tensor]
) -> None:
    assert not ds_kernels.triton_available()
    out = ds_kernels.scaled_add(torch.ones(8), torch.ones(8), 2.0)
    assert launches == []
    torch.testing.assert_close(out, torch.full((8,), 3.0))


def test_without_triton_forced_triton_raises(no_triton: None) -> None:
    with pytest.raises(RuntimeError, match=r"backend='triton'\): Triton failed to import"):
        ds_kernels.scaled_add(torch.ones(8), torch.ones(8), 2.0, backend="triton")


def test_package_works_when_triton_cannot_be_imported(tmp_path) -> None:
    # A None entry in sys.modules makes `import triton` raise ImportError, as if not installed.
    script = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, ds_kernels\n"
        "assert not ds_kernels.triton_available()\n"
        "out = ds_kernels.scaled_add(torch.ones(3), torch.ones(3), 2.0)\n"
        "assert out.tolist() == [3.0, 3.0, 3.0], out\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda d: torch.ones(4, 2, device=d)[:, 0], "needs contiguous tensors"),
        (lambda d: torch.ones(4, dtype=torch.float64, device=d), "got torch.float64"),
        (lambda d: torch.ones(4, dtype=torch.int32, device=d), "got torch.int32"),
    ],
)
def test_forced_triton_names_what_it_cannot_take(
    triton_device: torch.device, make, match: str
) -> None:
    x = make(triton_device)
    with pytest.raises(ValueError, match=match):
        ds_kernels.scaled_add(x, x.clone(), 1, backend="triton")
    torch.testing.assert_close(ds_kernels.scaled_add(x, x.clone(), 1), x * 2)  # reference


def test_forced_triton_refuses_autograd(triton_device: torch.device) -> None:
    x = torch.ones(4, device=triton_device, requires_grad=True)
    with pytest.raises(ValueError, match="does not record autograd"):
        ds_kernels.scaled_add(x, x, 1.0, backend="triton")


def test_autograd_goes_through_reference(launches: list[torch.Tensor]) -> None:
    x = torch.ones(4, requires_grad=True)
    ds_kernels.scaled_add(torch.zeros(4), x, 3.0).sum().backward()
    assert launches == []
    torch.testing.assert_close(x.grad, torch.full((4,), 3.0))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_forced_triton_on_cpu_without_interpreter_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_triton, "is_interpreted", lambda kernel: False)
    with pytest.raises(ValueError, match=r"needs CUDA tensors \(or CPU tensors with TRITON_INT"):
        ds_kernels.scaled_add(torch.ones(4), torch.ones(4), 1.0, backend="triton")


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
        ds_kernels.scaled_add(x, y, 1.0)


def test_dtype_mismatch_raises() -> None:
    with pytest.raises(TypeError, match=r"same dtype, got torch\.float16 and torch\.float32"):
        ds_kernels.scaled_add(torch.ones(4, dtype=torch.float16), torch.ones(4), 1.0)


@pytest.mark.parametrize("alpha", [torch.tensor(1.0), "1.0", True, None])
def test_alpha_must_be_a_real_number(alpha: object) -> None:
    with pytest.raises(TypeError, match="alpha must be a real number"):
        ds_kernels.scaled_add(torch.ones(4), torch.ones(4), alpha)  # type: ignore[arg-type]


def test_unknown_backend_raises() -> None:
    with pytest.raises(ValueError, match="backend must be 'triton', 'torch' or None, got 'cuda'"):
        ds_kernels.scaled_add(torch.ones(4), torch.ones(4), 1.0, backend="cuda")  # type: ignore[arg-type]
