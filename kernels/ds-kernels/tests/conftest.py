"""Without a GPU, run the Triton kernels in Triton's interpreter on CPU tensors.

Triton reads TRITON_INTERPRET when a kernel is decorated, that is when ds_kernels is imported,
so it is set here, before any test module imports ds_kernels.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

# The interpreter imports numpy (in the test dependency group); without it, interpreter tests skip.
if not torch.cuda.is_available() and importlib.util.find_spec("numpy") is not None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def triton_device() -> torch.device:
    """Where the Triton path can run here: CUDA, else CPU under the interpreter, else skip."""
    from ds_kernels import _scaled_add, _triton

    if not _triton.triton_available():
        pytest.skip(str(_triton.unavailable_reason()))
    if torch.cuda.is_available():
        return torch.device("cuda")
    if _triton.is_interpreted(_scaled_add._scaled_add_kernel):
        return torch.device("cpu")
    pytest.skip(
        "no GPU and the Triton kernels are not interpreted: TRITON_INTERPRET=1 needs numpy and "
        "must be set before ds_kernels is imported (run these tests in their own process)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On a CUDA machine, every test that runs Triton on the device joins the GPU tier.

    Without CUDA those tests run under the interpreter in the default tier, so they are not
    marked there (the ``gpu`` marker would skip them).
    """
    if not torch.cuda.is_available():
        return
    for item in items:
        if "triton_device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.gpu)
