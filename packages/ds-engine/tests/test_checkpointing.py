"""``deepspeed.checkpointing``: gradients with activation checkpointing equal those without
(fp32), dropout is replayed (default generator and the RNG tracker), non-tensor outputs, frozen
parameters and data inputs, CPU-held and partitioned (2 gloo ranks) saved inputs, the options
of ``configure`` and the RNG tracker."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from ds_testing import run_on_ranks


@pytest.fixture(autouse=True)
def _defaults():
    from ds_engine import checkpointing

    checkpointing.configure(None)
    checkpointing.get_cuda_rng_tracker().reset()
    yield
    checkpointing.configure(None)


class Block(nn.Module):
    def __init__(self, dropout: float = 0.0, tracked: bool = False) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 12), nn.Linear(12, 6)
        self.dropout, self.tracked = dropout, tracked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ds_engine.checkpointing import get_cuda_rng_tracker

        h = torch.tanh(self.a(x))
        h = nn.functional.dropout(h, self.dropout, training=True)
        if self.tracked:
            with get_cuda_rng_tracker().fork():
                h = nn.functional.dropout(h, 0.3, training=True)
        return x + self.b(h)


def _grads(
    ckpt, dropout: float = 0.0, tracked: bool = False, x_grad: bool = True
) -> list[torch.Tensor]:
    """Loss gradients of two blocks (the first through ``ckpt`` unless None) and the input."""
    from ds_engine import checkpointing

    torch.manual_seed(0)
    first, second = Block(dropout, tracked), Block(dropout, tracked)
    x = torch.randn(5, 6, requires_grad=x_grad)
    torch.manual_seed(7)
    checkpointing.get_cuda_rng_tracker().reset()
    checkpointing.get_cuda_rng_tracker().add("model-parallel-rng", 99)
    h = first(x) if ckpt is None else ckpt(first, x)
    second(h).pow(2).sum().backward()
    params = [*first.parameters(), *second.parameters()]
    return [p.grad for p in params] + ([x.grad] if x_grad else [])


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for u, v in zip(a, b):
        assert torch.allclose(u, v, atol=1e-6, rtol=0), (u - v).abs().max()


@pytest.mark.parametrize("which", ["checkpoint", "non_reentrant_checkpoint"])
def test_gradients_equal_without_checkpointing(which: str) -> None:
    from ds_engine import checkpointing

    ckpt = getattr(checkpointing, which)
    _same(_grads(ckpt), _grads(None))
    _same(_grads(ckpt, dropout=0.5), _grads(None, dropout=0.5))  # the mask is replayed
    _same(_grads(ckpt, dropout=0.2, tracked=True), _grads(None, dropout=0.2, tracked=True))


def test_tracker_state_advances_once_per_forward() -> None:
    from ds_engine import checkpointing

    _grads(checkpointing.checkpoint, tracked=True)
    after_ckpt = checkpointing.get_cuda_rng_tracker().get_states()["model-parallel-rng"]
    cpu_after_ckpt = torch.get_rng_state()
    _grads(None, tracked=True)
    after_plain = checkpointing.get_cuda_rng_tracker().get_states()["model-parallel-rng"]
    assert torch.equal(after_ckpt, after_plain)  # the rerun did not advance it again
    assert torch.equal(cpu_after_ckpt, torch.get_rng_state())


def test_frozen_parameters_and_data_input() -> None:
    from ds_engine import checkpointing

    def run(ckpt):
        torch.manual_seed(0)
        block = Block()
        block.a.requires_grad_(False)
        x = torch.randn(4, 6)  # data: no gradient
        out = block(x) if ckpt is None else ckpt(block, x)
        out.pow(2).sum().backward()
        assert block.a.weight.grad is None
        return [block.b.weight.grad, block.b.bias.grad]

    _same(run(checkpointing.checkpoint), run(None))
    _same(run(checkpointing.non_reentrant_checkpoint), run(None))


def test_non_tensor_outputs_and_kwargs() -> None:
    from ds_engine import checkpointing

    lin = nn.Linear(3, 3)

    def fn(x, *, scale, tag):
        y = lin(x) * scale
        return y, tag, None, y.argmax(-1)

    x = torch.randn(2, 3, requires_grad=True)
    y, tag, nothing, index = checkpointing.checkpoint(fn, x, scale=2.0, tag="t")
    assert tag == "t" and nothing is None and index.dtype == torch.int64
    y.sum().backward()
    want = lin.weight.grad.clone()
    lin.weight.grad = None
    fn(x, scale=2.0, tag="t")[0].sum().backward()
    assert torch.allclose(lin.weight.grad, want)
    with torch.no_grad():  # no graph: just the function
        assert checkpointing.checkpoint(fn, x, scale=1.0, tag="u")[1] == "u"


def test_checkpoint_in_cpu() -> None:
    from ds_engine import checkpointing

    checkpointing.configure(None, checkpoint_in_cpu=True, synchronize=True, profile=True)
    _same(_grads(checkpointing.checkpoint, dropout=0.3), _grads(None, dropout=0.3))
    with pytest.raises(NotImplementedError, match="checkpoint_in_cpu"):
        checkpointing.non_reentrant_checkpoint(torch.sin, torch.ones(1))


class _WorldMpu:
    """Every rank in one model-parallel group (they hold the same activations)."""

    def get_model_parallel_group(self):
        import torch.distributed as dist

        return dist.group.WORLD

    def get_model_parallel_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank()

    def get_model_parallel_world_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size()


def _partition_body(rank: int, world_size: int, in_cpu: bool) -> None:
    from ds_engine import checkpointing

    checkpointing.configure(_WorldMpu(), partition_activations=True, checkpoint_in_cpu=in_cpu)
    kept: list[int] = []
    original = checkpointing._Saved.__init__

    def spy(self, t, options, position=0):
        original(self, t, options, position)
        kept.append(self.data.numel())

    checkpointing._Saved.__init__ = spy
    try:
        got = _grads(checkpointing.checkpoint, dropout=0.25)
    finally:
        checkpointing._Saved.__init__ = original
    assert kept == [-(-30 // world_size)]  # the 5x6 input: this rank's part only
    checkpointing.configure(None)
    _same(got, _grads(None, dropout=0.25))


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_partition_activations(world_size: int) -> None:
    run_on_ranks(_partition_body, world_size, False)


def test_partition_activations_in_cpu() -> None:
    run_on_ranks(_partition_body, 2, True)


def _contiguous_body(rank: int, world_size: int, in_cpu: bool) -> None:
    from ds_engine import checkpointing

    def run(ckpt, slots: int) -> tuple[list[torch.Tensor], list[checkpointing._Saved]]:
        saved: list[checkpointing._Saved] = []
        original = checkpointing._Saved.__init__

        def spy(self, t, options, position=0):
            original(self, t, options, position)
            saved.append(self)

        checkpointing.configure(
            _WorldMpu(),
            deepspeed_config={
                "activation_checkpointing": {
                    "partition_activations": True,
                    "contiguous_memory_optimization": True,
                    "cpu_checkpointing": in_cpu,
                    "number_checkpoints": slots,
                }
            },
        )
        torch.manual_seed(0)
        blocks = [Block(0.2) for _ in range(3)]
        x = torch.randn(5, 6, requires_grad=True)
        torch.manual_seed(7)
        checkpointing._Saved.__init__ = spy
        try:
            h = x
            for block in blocks:
                h = block(h) if ckpt is None else ckpt(block, h)
            h.pow(2).sum().backward()
        finally:
            checkpointing._Saved.__init__ = original
        return [p.grad for b in blocks for p in b.parameters()] + [x.grad], saved

    got, saved = run(checkpointing.checkpoint, 3)
    # The three checkpoints' slices sit back to back in one buffer (one storage).
    assert len({s.data.untyped_storage().data_ptr() for s in saved}) == 1
    offsets = [s.data.storage_offset() for s in saved]
    assert offsets == [k * -(-30 // world_size) for k in range(3)]
    assert saved[0].data.device.type == ("cpu" if in_cpu else saved[0].device.type)
    with pytest.raises(ValueError, match="number_checkpoints = 2"):
        run(checkpointing.checkpoint, 2)
    checkpointing.configure(None)
    checkpointing.reset()
    want, _ = run(None, 3)
    checkpointing.configure(None)  # the worker is reused: leave no options behind
    _same(got, want)


@pytest.mark.parametrize("in_cpu", [False, True])
def test_contiguous_memory_optimization(in_cpu: bool) -> None:
    run_on_ranks(_contiguous_body, 2, in_cpu)


def test_configure_options(tmp_path) -> None:
    from ds_engine import checkpointing

    assert checkpointing.is_configured()
    section = {"activation_checkpointing": {"cpu_checkpointing": True, "number_checkpoints": 4}}
    checkpointing.configure(None, deepspeed_config=section, profile=True)
    assert checkpointing._options.checkpoint_in_cpu and checkpointing._options.num_checkpoints == 4
    checkpointing.configure(None, deepspeed_config=section, checkpoint_in_cpu=False)
    assert not checkpointing._options.checkpoint_in_cpu  # arguments win over the file
    with pytest.raises(ValueError, match="cpu"):
        checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {"cpu": 1}})
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, **section}))
    checkpointing.configure(None, deepspeed_config=str(path))
    assert checkpointing._options.checkpoint_in_cpu
    from ds_engine import DeepSpeedConfig

    checkpointing.configure(
        None, deepspeed_config=DeepSpeedConfig.from_dict({"train_batch_size": 8})
    )
    assert not checkpointing._options.checkpoint_in_cpu
    with pytest.raises(ValueError, match="partition_activations"):
        checkpointing.configure(None, contiguous_checkpointing=True)
    with pytest.raises(ValueError, match="mpu"):
        checkpointing.configure(None, partition_activations=True)
    checkpointing.set_num_layers(3)
    assert checkpointing._options.num_checkpoints == 3
    checkpointing.reset()


def test_rng_tracker() -> None:
    from ds_comm.accelerator import get_accelerator
    from ds_engine.checkpointing import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    acc = get_accelerator()
    device = acc.current_device_name()  # the tracker holds the accelerator's generator states
    model_parallel_cuda_manual_seed(5)
    tracker = get_cuda_rng_tracker()
    default_draw = torch.rand(3, device=device)
    acc.manual_seed(5)
    assert torch.equal(torch.rand(3, device=device), default_draw)  # the default got the seed
    before = acc.get_rng_state()
    with tracker.fork():
        first = torch.rand(3, device=device)
    assert torch.equal(acc.get_rng_state(), before)  # fork left the default untouched
    acc.manual_seed(5 + 2718)
    assert torch.equal(torch.rand(3, device=device), first)
    states = tracker.get_states()
    with tracker.fork():
        second = torch.rand(3, device=device)
    assert not torch.equal(first, second)  # the tracked state advanced
    tracker.set_states(states)
    with tracker.fork():
        assert torch.equal(torch.rand(3, device=device), second)
    with pytest.raises(ValueError, match="seed"):
        tracker.add("other", 5 + 2718)
    with pytest.raises(KeyError, match="no state"), tracker.fork("missing"):
        pass
