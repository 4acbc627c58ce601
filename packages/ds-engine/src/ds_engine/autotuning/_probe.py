"""The engine's side of autotuning: one experiment measures itself, writes its metrics, exits.

With ``autotuning.enabled``, DeepSpeed's engine profiles the steps ``start_profile_step`` to
``end_profile_step``, writes ``latency``/``throughput``/``FLOPS_per_gpu`` to ``metric_path`` and
exits; the autotuner reads that file. ds does the same and adds what its memory prediction is
checked against: the peak bytes per rank (max over ranks, see [Note: what the CPU peak counts])
over the steps before ``start_profile_step``, and the bytes one forward keeps for backward (the
activations). Memory is measured on steps of its own so that the CPU tracker's bookkeeping does
not slow the timed steps.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch
from torch import nn

import ds_comm
from ds_engine.autotuning._config import AutotuningConfig
from ds_engine.autotuning._live_bytes import PeakMemory

__all__ = ["AutotuningProbe", "start_probe"]


def start_probe(section: Any, engine: Any) -> AutotuningProbe | None:
    """A probe when the config's ``autotuning.enabled`` is true, else None (a disabled
    section is inert, whatever its other keys say, as in DeepSpeed)."""
    if section is None or not section.get("enabled", False):
        return None
    return AutotuningProbe(AutotuningConfig.from_section(section), engine)


class AutotuningProbe:
    """Measures one engine's run: memory over steps ``1..start-1``, time over ``start..end``."""

    def __init__(self, config: AutotuningConfig, engine: Any) -> None:
        self.config = config
        self.memory = PeakMemory(engine.device)
        self.activation_bytes = 0
        self.activation_peak_bytes = 0
        self.resident_bytes = 0
        self._before_forward = 0
        self._flops = 0
        self._t0 = 0.0
        self._in_window = False
        module: nn.Module = engine.module
        self._hooks = [
            module.register_forward_pre_hook(self._pre_forward),
            module.register_forward_hook(self._post_forward),
        ]
        optimizer = getattr(engine, "basic_optimizer", None)
        if isinstance(optimizer, torch.optim.Optimizer):
            self._hooks.append(optimizer.register_step_pre_hook(self._pre_step))
            self._hooks.append(optimizer.register_step_post_hook(self._phase("other")))
        self.memory.start()
        self.resident_bytes = self.memory.current - _engine_state_bytes(engine)
        self._counter = self._start_flop_counter() if config.metric == "flops" else None

    def _phase(self, name: str) -> Any:
        def mark(*args: Any) -> None:
            self.memory.set_phase(name)

        return mark

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        self.memory.set_phase("forward")
        self._before_forward = self.memory.mark()
        self._in_window = True

    def _pre_step(self, *args: Any) -> None:
        """The optimizer starts stepping: the forward-backward window ends."""
        self.memory.set_phase("step")
        if self._in_window:
            self._in_window = False
            above = self.memory.window_peak() - self._before_forward
            self.activation_peak_bytes = max(self.activation_peak_bytes, above)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        kept = self.memory.current - self._before_forward
        self.memory.set_phase("backward")
        self.activation_bytes = max(self.activation_bytes, kept)

    def _start_flop_counter(self) -> Any:
        from torch.utils.flop_counter import FlopCounterMode

        counter = FlopCounterMode(display=False)
        counter.__enter__()
        return counter

    def after_step(self, engine: Any) -> None:
        """Call at each accumulation boundary, after ``global_steps`` counted it."""
        step = engine.global_steps
        if step == self.config.start_profile_step - 1:
            if self._counter is not None:
                self._counter.__exit__(None, None, None)
                self._flops = int(self._counter.get_total_flops()) // step
                self._counter = None
            self.memory.stop()
            for hook in self._hooks:
                hook.remove()
            engine_device_sync(engine)
            self._t0 = time.perf_counter()
        elif step == self.config.end_profile_step:
            engine_device_sync(engine)
            latency = (time.perf_counter() - self._t0) / (step - self.config.start_profile_step + 1)
            self._finish(engine, latency)

    def _finish(self, engine: Any, latency: float) -> None:
        peak, activation, activation_peak, resident = _max_over_ranks(
            engine,
            [
                self.memory.peak,
                self.activation_bytes,
                self.activation_peak_bytes,
                self.resident_bytes,
            ],
        )
        if engine.global_rank == 0:
            metrics = _metrics(engine, self, latency, peak, activation)
            metrics["activation_peak_bytes"] = activation_peak
            metrics["other_resident_bytes"] = resident
            if self._model_info_requested():
                _write_json(self.config.model_info_file, metrics["model_info"])
            _write_json(self.config.metric_file, metrics)
            print(f"autotuning: wrote {self.config.metric_file}", flush=True)
        if ds_comm.is_initialized():
            ds_comm.barrier()
        sys.exit(0)  # DeepSpeed's engine exits after end_profile_step too

    def _model_info_requested(self) -> bool:
        info = self.config.model_info
        return bool(info and info.get("profile"))


def _engine_state_bytes(engine: Any) -> int:
    """Device bytes of the engine's model states and buffers right now (at construction:
    parameters, gradient buffers, master copies; the optimizer's state comes at step 1)."""
    b = engine.memory_usage()
    return b.params + b.grads + b.optimizer_state + b.buffers - b.host


def engine_device_sync(engine: Any) -> None:
    """Wait for the device's queued work, so the clock measures it."""
    from ds_comm.accelerator import get_accelerator

    get_accelerator().synchronize()


def _max_over_ranks(engine: Any, values: list[int]) -> list[int]:
    if not ds_comm.is_initialized() or engine.world_size == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=engine.device)
    ds_comm.all_reduce(tensor, op=ds_comm.ReduceOp.MAX)
    return [int(v) for v in tensor.tolist()]


def _metrics(
    engine: Any, probe: AutotuningProbe, latency: float, peak: int, activation: int
) -> dict[str, Any]:
    total, largest = _count_params(engine.module)
    trainable = sum(
        {id(p): p.numel() for p in engine.module.parameters() if p.requires_grad}.values()
    )
    first = next(engine.module.parameters(), None)
    batch = engine.train_batch_size()
    breakdown = engine.memory_usage()
    metrics: dict[str, Any] = {
        "latency": latency,
        "throughput": batch / latency,
        "peak_memory_bytes": peak,
        "peak_memory_counts": probe.memory.counts,
        "activation_bytes": activation,
        "phase_peaks_rank0": probe.memory.phase_peaks,
        "micro_batch_size": engine.train_micro_batch_size_per_gpu(),
        "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
        "train_batch_size": batch,
        "memory_breakdown": {
            k: getattr(breakdown, k)
            for k in ("params", "grads", "optimizer_state", "buffers", "host")
        },
        "model_info": {
            "num_params": total,
            "trainable_num_params": trainable,
            "largest_layer_params": largest,
            "param_bytes": first.element_size() if first is not None else 4,
            "activation_mem_per_gpu": activation,
        },
    }
    if probe._flops:
        metrics["FLOPS_per_gpu"] = probe._flops / latency
    return metrics


def _count_params(module: nn.Module) -> tuple[int, int]:
    """``(parameters, parameters of the largest module)``, shared ones once, ZeRO-3
    partitioned ones at their full ``ds_numel``."""

    def numel(p: torch.Tensor) -> int:
        return int(getattr(p, "ds_numel", p.numel()))

    total = sum({id(p): numel(p) for p in module.parameters()}.values())
    largest = max(
        (sum(numel(p) for p in m.parameters(recurse=False)) for m in module.modules()), default=0
    )
    return total, largest


def _write_json(path: str, value: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(value, f, indent=1)
