"""The accelerator abstraction on CPU: selection, devices, RNG, host streams/events, memory, builders.

Every test runs for real on this host (no mocks): timings come from the host clock, memory from
``/proc``. CUDA behaviour is in ``test_accelerator_cuda.py`` (``gpu`` marker).
"""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

from ds_comm import accelerator as acc_mod
from ds_comm.accelerator import (
    CPU_Accelerator,
    CUDA_Accelerator,
    DeepSpeedAccelerator,
    HostEvent,
    HostStream,
    get_accelerator,
    is_current_accelerator_supported,
    register_op_builder,
    set_accelerator,
    unregister_op_builder,
)
from ds_comm.api import ConfigError

MiB = 1 << 20


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch):
    """Forget the chosen accelerator before and after the test."""
    set_accelerator(None)
    yield monkeypatch
    set_accelerator(None)


@pytest.fixture
def cpu() -> CPU_Accelerator:
    return CPU_Accelerator()


# --- selection -----------------------------------------------------------------------------------


def test_env_selects_cpu(fresh: pytest.MonkeyPatch) -> None:
    fresh.setenv("DS_ACCELERATOR", "cpu")
    acc = get_accelerator()
    assert isinstance(acc, CPU_Accelerator) and acc._name == "cpu"
    assert get_accelerator() is acc  # chosen once
    assert is_current_accelerator_supported()


def test_default_follows_cuda_availability(fresh: pytest.MonkeyPatch) -> None:
    fresh.delenv("DS_ACCELERATOR", raising=False)
    expected = CUDA_Accelerator if torch.cuda.is_available() else CPU_Accelerator
    assert type(get_accelerator()) is expected


@pytest.mark.parametrize("value", ["tpu", "gpu", "CPUS"])
def test_bad_env_value_is_a_clear_error(fresh: pytest.MonkeyPatch, value: str) -> None:
    fresh.setenv("DS_ACCELERATOR", value)
    with pytest.raises(ConfigError, match=rf"DS_ACCELERATOR='{value}' is not an accelerator.*cpu"):
        get_accelerator()


def test_deepspeed_only_accelerator_is_refused(fresh: pytest.MonkeyPatch) -> None:
    fresh.setenv("DS_ACCELERATOR", "xpu")
    with pytest.raises(ConfigError, match="xpu accelerator is not implemented in ds"):
        get_accelerator()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a host without CUDA")
def test_cuda_requested_without_cuda(fresh: pytest.MonkeyPatch) -> None:
    fresh.setenv("DS_ACCELERATOR", "cuda")
    with pytest.raises(ConfigError, match=r"torch.cuda.is_available\(\) is False"):
        get_accelerator()


def test_set_accelerator_takes_a_subclass_and_rejects_others(fresh: pytest.MonkeyPatch) -> None:
    class Custom(CPU_Accelerator):
        def device_name(self, device_index: int | None = None) -> str:
            return "mydev"

    custom = Custom()
    set_accelerator(custom)
    assert get_accelerator() is custom
    assert not is_current_accelerator_supported()
    with pytest.raises(TypeError, match="not a subclass of DeepSpeedAccelerator"):
        set_accelerator(object())  # type: ignore[arg-type]
    assert get_accelerator() is custom


def test_abstract_base_requires_the_device_methods() -> None:
    class Incomplete(DeepSpeedAccelerator):
        def is_synchronized_device(self) -> bool:
            return True

    with pytest.raises(TypeError, match="abstract"):
        Incomplete()  # type: ignore[abstract]


# --- devices -------------------------------------------------------------------------------------


def test_device_queries(cpu: CPU_Accelerator, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu.device_name() == cpu.device_name(3) == cpu.current_device_name() == "cpu"
    assert cpu.device_name("0") == "cpu"  # transformers passes os.environ["LOCAL_RANK"]
    assert CUDA_Accelerator().device_name("2") == "cuda:2"  # names only: no GPU needed
    assert cpu.device(0) == torch.device("cpu")
    assert cpu.communication_backend_name() == "gloo"
    assert cpu.is_available() and cpu.is_synchronized_device()
    assert cpu.use_host_timers() and cpu.resolves_data_dependency()
    assert cpu.handles_memory_backpressure()
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert cpu.current_device() == 3
    monkeypatch.delenv("LOCAL_RANK")
    assert cpu.current_device() == 0
    monkeypatch.setenv("LOCAL_SIZE", "4")
    assert cpu.device_count() == 4
    monkeypatch.delenv("LOCAL_SIZE")
    assert cpu.device_count() >= 1
    cpu.set_device(0)
    with pytest.raises(ValueError, match="set_device"):
        cpu.set_device(-1)
    cpu.synchronize()
    x = torch.ones(2)
    assert cpu.on_accelerator(x) and not cpu.on_accelerator(x.to("meta"))


def test_dtypes_and_tensor_factories(cpu: CPU_Accelerator) -> None:
    assert cpu.is_bf16_supported() and cpu.is_fp64_supported()
    assert torch.float32 in cpu.supported_dtypes() and torch.bfloat16 in cpu.supported_dtypes()
    assert (torch.float16 in cpu.supported_dtypes()) == cpu.is_fp16_supported()
    factories = {
        "BFloat16Tensor": torch.bfloat16,
        "ByteTensor": torch.uint8,
        "DoubleTensor": torch.float64,
        "FloatTensor": torch.float32,
        "HalfTensor": torch.float16,
        "IntTensor": torch.int32,
        "LongTensor": torch.int64,
    }
    for name, dtype in factories.items():
        t = getattr(cpu, name)([1, 2, 3])
        assert t.dtype == dtype and t.device.type == "cpu" and t.tolist() == [1, 2, 3], name
    assert not cpu.is_triton_supported()
    assert cpu.amp() is torch.cpu.amp


# --- random number generation --------------------------------------------------------------------


def test_rng_state_round_trips(cpu: CPU_Accelerator) -> None:
    gen = cpu.manual_seed(1234)
    assert gen is cpu.default_generator(0) and cpu.initial_seed() == 1234
    state = cpu.get_rng_state()
    first = torch.rand(5)
    cpu.set_rng_state(state)
    assert torch.equal(torch.rand(5), first)
    cpu.manual_seed_all(1234)
    assert torch.equal(torch.rand(5), first)
    assert cpu.random() is torch.random


# --- streams and events --------------------------------------------------------------------------


def test_event_times_on_the_host_clock(cpu: CPU_Accelerator) -> None:
    start, end = cpu.Event(enable_timing=True), cpu.Event(enable_timing=True)
    start.record()
    time.sleep(0.05)
    end.record()
    cpu.synchronize()
    ms = start.elapsed_time(end)
    assert 45.0 <= ms < 2000.0, ms
    assert start.query() and end.query()
    end.synchronize()
    end.wait(cpu.current_stream())


def test_event_misuse_is_an_error(cpu: CPU_Accelerator) -> None:
    untimed, timed, unrecorded = cpu.Event(), cpu.Event(enable_timing=True), HostEvent(True)
    untimed.record()
    timed.record()
    with pytest.raises(RuntimeError, match="enable_timing"):
        untimed.elapsed_time(timed)
    with pytest.raises(RuntimeError, match="never recorded"):
        timed.elapsed_time(unrecorded)


def test_streams_switch_per_thread(cpu: CPU_Accelerator) -> None:
    default = cpu.default_stream()
    assert cpu.current_stream() is default and isinstance(default, HostStream)
    side = cpu.Stream()
    seen_in_thread: list[HostStream] = []
    with cpu.stream(side):
        assert cpu.current_stream() is side
        worker = threading.Thread(target=lambda: seen_in_thread.append(cpu.current_stream()))
        worker.start()
        worker.join()
        side.wait_stream(default)
        event = side.record_event()
        default.wait_event(event)
        assert side.query()
    assert seen_in_thread == [default]  # another thread keeps its own current stream
    assert cpu.current_stream() is default
    with cpu.stream(None):
        assert cpu.current_stream() is default
    with pytest.raises(TypeError, match="HostStream"), cpu.stream("cuda:0"):  # type: ignore[arg-type]
        pass


# --- memory --------------------------------------------------------------------------------------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_memory_figures_follow_the_process(cpu: CPU_Accelerator) -> None:
    before = cpu.memory_allocated()
    block = torch.ones(64 * MiB // 4)  # written, so resident
    grown = cpu.memory_allocated()
    assert grown - before >= 48 * MiB, (before, grown)
    peak = cpu.max_memory_allocated()
    assert peak >= grown and cpu.max_memory_reserved() >= cpu.memory_reserved() > 0
    stats = cpu.memory_stats()
    assert stats["allocated_bytes.all.peak"] >= stats["allocated_bytes.all.current"] > 0
    del block
    cpu.empty_cache()
    cpu.reset_peak_memory_stats()
    after_reset = cpu.max_memory_allocated()
    assert after_reset < peak - 32 * MiB, (peak, after_reset)  # the freed block no longer counts
    cpu.reset_max_memory_allocated()
    assert cpu.max_memory_cached() >= cpu.memory_cached() > 0
    total, free = cpu.total_memory(), cpu.available_memory()
    assert total >= free > 0 and total > grown


# --- host memory pinning, envs, compile backend, ranges ------------------------------------------


def test_pinning_is_a_no_op_on_cpu(cpu: CPU_Accelerator) -> None:
    x = torch.arange(6.0)
    assert cpu.pin_memory(x) is x and not cpu.is_pinned(x) and not cpu.pins_host_memory()
    fresh = cpu.pin_memory(x.view(2, 3), make_copy=False)
    assert fresh.shape == (2, 3) and fresh.dtype == x.dtype and fresh.data_ptr() != x.data_ptr()
    flat = cpu.pin_memory(x.view(2, 3), make_copy=False, match_shape=False)
    assert flat.shape == (6,)
    assert cpu.pin_empty(2, 3, dtype=torch.int16).shape == (2, 3)
    assert cpu.pin_empty_like(x, dtype=torch.float16).dtype == torch.float16
    with pytest.raises(ValueError, match="host memory"):
        cpu.pin_empty(2, dtype=torch.float32, device="meta")
    assert cpu.unpin_memory(x) is None and cpu.pin_memory_alignment() == 1


def test_visible_devices_and_exports(cpu: CPU_Accelerator) -> None:
    env: dict[str, str] = {}
    cpu.set_visible_devices_envs(env, [0, 2])
    assert env == {"CUDA_VISIBLE_DEVICES": "0,2"} and cpu.export_envs() == []
    assert CUDA_Accelerator().export_envs() == ["NCCL"]


def test_compile_backend(cpu: CPU_Accelerator) -> None:
    assert cpu.get_compile_backend() == "inductor"
    cpu.set_compile_backend("eager")
    assert cpu.get_compile_backend() == "eager"
    with pytest.raises(ValueError, match=r"not-a-backend.*choose from"):
        cpu.set_compile_backend("not-a-backend")


def test_ranges_show_in_the_profiler_and_lazy_call_runs(cpu: CPU_Accelerator) -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        cpu.range_push("ds_comm_test_range")
        torch.ones(3).add_(1)
        cpu.range_pop()
    assert any(e.name == "ds_comm_test_range" for e in prof.events())
    with pytest.raises(RuntimeError, match="without a matching"):
        cpu.range_pop()
    assert cpu.lazy_call(lambda: 41 + 1) == 42


def test_graphs_are_refused_on_cpu(cpu: CPU_Accelerator) -> None:
    assert not cpu.is_current_stream_capturing()
    with pytest.raises(NotImplementedError, match="graphs are not implemented for the cpu"):
        cpu.create_graph()


# --- op builders ---------------------------------------------------------------------------------


class _FakeAdamBuilder:
    NAME = "fake_adam"


class _OtherBuilder:
    pass


def test_op_builder_registry(cpu: CPU_Accelerator) -> None:
    name = "DsCommTestAdamBuilder"
    try:
        register_op_builder(name, _FakeAdamBuilder, devices=["cpu"])
        register_op_builder(name, _FakeAdamBuilder, devices=["cpu"])  # same class: no-op
        assert cpu.get_op_builder(name) is _FakeAdamBuilder
        assert isinstance(cpu.create_op_builder(name), _FakeAdamBuilder)
        assert acc_mod.registered_op_builders("cpu")[name] is _FakeAdamBuilder
        assert name not in acc_mod.registered_op_builders("cuda")
        with pytest.raises(ValueError, match=r"already registered for cpu.*replace=True"):
            register_op_builder(name, _OtherBuilder, devices=["cpu"])
        register_op_builder(name, _OtherBuilder, devices=["cpu"], replace=True)
        assert cpu.get_op_builder(name) is _OtherBuilder
        with pytest.raises(TypeError, match="expected a class"):
            register_op_builder(name, _OtherBuilder(), devices=["cpu"])  # type: ignore[arg-type]
    finally:
        unregister_op_builder(name)
    assert name not in acc_mod.registered_op_builders("cpu")


def test_op_builders_register_when_their_module_is_imported(tmp_path, monkeypatch) -> None:
    module = "ds_comm_test_builders_pkg"
    (tmp_path / f"{module}.py").write_text(
        "from ds_comm.accelerator import register_op_builder\n"
        "class LazyBuilder:\n    pass\n"
        "register_op_builder('LazyBuilder', LazyBuilder)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    class Here(CPU_Accelerator):
        def op_builder_dir(self) -> str:
            return module

    class Nowhere(CPU_Accelerator):
        def op_builder_dir(self) -> str:
            return "ds_comm_no_such_builder_module"

    try:
        assert Nowhere().get_op_builder("LazyBuilder") is None  # module missing: no builder
        assert Nowhere().create_op_builder("LazyBuilder") is None
        found = Here().get_op_builder("LazyBuilder")
        assert found is not None and found.__name__ == "LazyBuilder"
        assert Here().get_op_builder("NoSuchBuilder") is None
    finally:
        unregister_op_builder("LazyBuilder")
        sys.modules.pop(module, None)
