"""The CUDA accelerator on a real GPU: devices, streams/events, memory, RNG, pinning, graphs.

Skipped without CUDA (``gpu`` marker). Each check compares against ``torch.cuda`` directly or
against a quantity the test controls (bytes allocated, a kernel's duration).
"""

from __future__ import annotations

import time

import pytest
import torch

from ds_comm.accelerator import CUDA_Accelerator, get_accelerator, set_accelerator

pytestmark = pytest.mark.gpu(1)
MiB = 1 << 20


@pytest.fixture
def cuda() -> CUDA_Accelerator:
    acc = CUDA_Accelerator()
    acc.set_device(0)
    return acc


def test_selected_by_default_and_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    set_accelerator(None)
    try:
        monkeypatch.delenv("DS_ACCELERATOR", raising=False)
        assert isinstance(get_accelerator(), CUDA_Accelerator)
        set_accelerator(None)
        monkeypatch.setenv("DS_ACCELERATOR", "cuda")
        acc = get_accelerator()
        assert isinstance(acc, CUDA_Accelerator) and acc._name == "cuda"
    finally:
        set_accelerator(None)


def test_device_queries(cuda: CUDA_Accelerator) -> None:
    assert cuda.device_name() == "cuda" and cuda.device_name(1) == "cuda:1"
    assert cuda.device_name("1") == "cuda:1"  # transformers passes os.environ["LOCAL_RANK"]
    assert cuda.device(0) == torch.device("cuda", 0)
    assert cuda.current_device() == torch.cuda.current_device() == 0
    assert cuda.current_device_name() == "cuda:0"
    assert cuda.device_count() == torch.cuda.device_count() >= 1
    assert cuda.communication_backend_name() == "nccl"
    assert cuda.is_available() and not cuda.is_synchronized_device()
    assert not cuda.use_host_timers()
    x = torch.ones(2, device=cuda.current_device_name())
    assert cuda.on_accelerator(x) and not cuda.on_accelerator(x.cpu())
    assert isinstance(cuda.communication_backend_version(), (int, tuple))


def test_dtypes_and_factories(cuda: CUDA_Accelerator) -> None:
    assert cuda.is_bf16_supported() == torch.cuda.is_bf16_supported()
    assert torch.float32 in cuda.supported_dtypes()
    t = cuda.HalfTensor([1, 2])
    assert t.device.type == "cuda" and t.dtype == torch.float16
    assert cuda.amp() is torch.cuda.amp
    major, _ = torch.cuda.get_device_capability()
    assert cuda.is_triton_supported() == (major >= 8)


def test_event_timing_measures_device_work(cuda: CUDA_Accelerator) -> None:
    x = torch.randn(2048, 2048, device="cuda")
    start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        x = x @ x
        x = x / x.norm()
    end.record()
    host_start = time.perf_counter()
    cuda.synchronize()
    host_wait_ms = (time.perf_counter() - host_start) * 1000
    ms = start.elapsed_time(end)
    assert ms > 0.0
    assert ms >= host_wait_ms * 0.5  # the device clock covers the work the host waited for


def test_streams(cuda: CUDA_Accelerator) -> None:
    side = cuda.Stream()
    assert cuda.current_stream() == cuda.default_stream()
    a = torch.ones(1 << 20, device="cuda")
    side.wait_stream(cuda.current_stream())
    with cuda.stream(side):
        assert cuda.current_stream() == side
        b = a * 3
    cuda.current_stream().wait_stream(side)
    assert cuda.current_stream() == cuda.default_stream()
    assert torch.equal(b, torch.full_like(a, 3.0))


def test_memory_figures(cuda: CUDA_Accelerator) -> None:
    cuda.empty_cache()
    cuda.reset_peak_memory_stats()
    before = cuda.memory_allocated()
    block = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    assert cuda.memory_allocated() - before == 64 * MiB
    assert cuda.max_memory_allocated() >= before + 64 * MiB
    assert cuda.memory_reserved() >= cuda.memory_allocated()
    assert cuda.max_memory_reserved() >= cuda.memory_reserved()
    assert cuda.memory_stats()["allocated_bytes.all.current"] == cuda.memory_allocated()
    del block
    cuda.reset_max_memory_allocated()
    assert cuda.max_memory_allocated() == cuda.memory_allocated() == before
    total, free = cuda.total_memory(), cuda.available_memory()
    assert total == torch.cuda.get_device_properties(0).total_memory > free > 0


def test_rng_round_trip(cuda: CUDA_Accelerator) -> None:
    cuda.manual_seed(77)
    assert cuda.initial_seed() == 77
    state = cuda.get_rng_state()
    first = torch.rand(8, device="cuda")
    cuda.set_rng_state(state)
    assert torch.equal(torch.rand(8, device="cuda"), first)
    cuda.set_rng_state(state, 0)
    assert torch.equal(torch.rand(8, device="cuda"), first)
    assert cuda.default_generator(0) is torch.cuda.default_generators[0]


def test_pinned_memory(cuda: CUDA_Accelerator) -> None:
    x = torch.arange(16.0)
    pinned = cuda.pin_memory(x)
    assert cuda.is_pinned(pinned) and not cuda.is_pinned(x) and cuda.pins_host_memory()
    assert torch.equal(pinned, x)
    assert cuda.is_pinned(cuda.pin_empty(4, 4, dtype=torch.float32))


def test_graph_capture_and_replay(cuda: CUDA_Accelerator) -> None:
    static = torch.zeros(4, device="cuda")
    side = cuda.Stream()
    side.wait_stream(cuda.current_stream())
    with cuda.stream(side):
        static.add_(1)  # warm-up outside capture
    cuda.current_stream().wait_stream(side)
    graph = cuda.create_graph()
    with cuda.capture_to_graph(graph):
        static.add_(1)
    cuda.replay_graph(graph)
    cuda.replay_graph(graph)
    cuda.synchronize()
    assert static.tolist() == [3.0] * 4  # warm-up + two replays (capturing runs nothing)


def test_nvtx_ranges_open_and_close(cuda: CUDA_Accelerator) -> None:
    # NVTX reports depths only while a profiler listens (else a negative code): check the calls
    outer = cuda.range_push("ds_comm.outer")
    inner = cuda.range_push("ds_comm.inner")
    assert isinstance(outer, int) and isinstance(inner, int)
    assert isinstance(cuda.range_pop(), int) and isinstance(cuda.range_pop(), int)
