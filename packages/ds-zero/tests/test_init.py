"""zero.Init: modules built inside are partitioned as they are built, identical on every rank
(rank 0's values), with ``apply``-style initialisation, dtype, offload, nesting, ``module=``; and
a model larger than a rank's memory budget builds under Init and not without it."""

from __future__ import annotations

import gc
import math
import resource

import pytest
import torch
from torch import nn

import ds_zero
from ds_testing import run_on_ranks
from ds_zero import ConfigError, GatheredParameters, Init, ZeroParamStatus

STAGE3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


class _Net(nn.Module):
    """Tied embedding and head, initialised through ``self.apply`` after the children exist."""

    def __init__(self, vocab: int = 11, dim: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.scale = nn.Parameter(torch.randn(dim))
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.5)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.uniform_(module.bias)


def _reference(seed: int = 100) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {n: p.detach().clone() for n, p in _Net().named_parameters()}


def _whole(model: nn.Module) -> dict[str, torch.Tensor]:
    with GatheredParameters(model.parameters()):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _built_under_init_body(rank: int, world_size: int) -> None:
    torch.manual_seed(100 + rank)  # ranks draw different values: rank 0's must win
    with Init(config_dict_or_path=STAGE3) as init:
        model = _Net()
    assert init.partitioner is not None
    # The head's own weight, partitioned before the tying replaced it, is not tracked.
    assert len(init.partitioner.params) == len(list(model.parameters())) == 8
    names = [n for n, _ in model.named_parameters()]
    assert names == list(_reference())  # tying survived (the head's weight is the embedding)
    for name, p in model.named_parameters():
        assert p.ds_status is ZeroParamStatus.NOT_AVAILABLE and p.numel() == 0, name
        assert p.ds_partitioner is init.partitioner
        assert p.ds_tensor.numel() == math.ceil(p.ds_numel / world_size)
        assert p.ds_name is not None
    assert model.head.weight is model.embed.weight
    for name, value in _whole(model).items():
        torch.testing.assert_close(value, _reference()[name], rtol=0, atol=0, msg=name)
    # The forward of the gathered model is the reference's.
    tokens = torch.tensor([[1, 2, 3]])
    torch.manual_seed(0)
    plain = _Net()
    plain.load_state_dict(_reference(), strict=False)
    with GatheredParameters(model.parameters()):
        x = model.norm(model.body(model.embed(tokens)) * model.scale)
        torch.testing.assert_close(
            model.head(x), plain.head(plain.norm(plain.body(plain.embed(tokens)) * plain.scale))
        )


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_modules_built_inside_init_are_partitioned_with_rank0_values(world_size: int) -> None:
    run_on_ranks(_built_under_init_body, world_size)


def _options_body(rank: int, world_size: int, nvme_path: str) -> None:
    # dtype from the argument and from the config's bf16 section; every parameter is
    # partitioned, small ones too (DeepSpeed's Init; the engine applies persistence later).
    with Init(dtype=torch.bfloat16):
        model = _Net(vocab=300, dim=400)
    assert model.embed.weight.dtype == torch.bfloat16 and model.embed.weight.numel() == 0
    assert model.embed.weight.ds_tensor.dtype == torch.bfloat16
    assert not model.scale.ds_persist and model.scale.numel() == 0
    with Init(config_dict_or_path={**STAGE3, "bf16": {"enabled": True}}):
        assert _Net().embed.weight.ds_tensor.dtype == torch.bfloat16
    # enabled=False builds a plain model.
    with Init(enabled=False):
        plain = _Net()
    assert not hasattr(plain.embed.weight, "ds_id") and plain.embed.weight.numel() == 66
    # module=: partition a model built without Init; every rank takes rank 0's values.
    torch.manual_seed(100 + rank)
    built = _Net()
    init = Init(module=built, config_dict_or_path=STAGE3)
    assert all(p.numel() == 0 for p in built.parameters())
    assert all(p.ds_partitioner is init.partitioner for p in built.parameters())
    assert all(torch.equal(v, _reference()[n]) for n, v in _whole(built).items())
    # mpu: its data-parallel group partitions (here a group of every rank, not the default).
    group = torch.distributed.new_group(list(range(world_size)))

    class Mpu:
        def get_data_parallel_group(self) -> object:
            return group

    with Init(mpu=Mpu(), config_dict_or_path=STAGE3) as init:
        assert nn.Linear(3, 5).weight.ds_process_group is group
    assert init.partitioner.group is group
    # remote_device: shards in host memory / in files.
    with Init(remote_device="cpu", config_dict_or_path=STAGE3):
        cpu_model = _Net()
    assert cpu_model.embed.weight.ds_partitioner.offload_device == "cpu"
    nvme = {"device": "nvme", "nvme_path": nvme_path, "max_in_cpu": 0}
    config = {"zero_optimization": {**STAGE3["zero_optimization"], "offload_param": nvme}}
    torch.manual_seed(100)
    with Init(config_dict_or_path=config) as init:
        nvme_model = _Net()
    store = init.partitioner.shard_store
    gc.collect()  # the head's own weight, replaced by the tying, is gone with its file
    assert isinstance(store, ds_zero.NvmeShardStore) and store.resident_numel == 0
    assert f"rank{rank}" in str(store.folder) and len(list(store.folder.iterdir())) == 8
    assert all(torch.equal(v, _reference()[n]) for n, v in _whole(nvme_model).items())


@pytest.mark.parametrize("world_size", [1, 2])
def test_init_options(world_size: int, tmp_path) -> None:
    run_on_ranks(_options_body, world_size, nvme_path=str(tmp_path))


def test_nested_init_shares_partitioner_and_restores_torch() -> None:
    original_init, original_apply = nn.Linear.__init__, nn.Module.apply
    with Init(config_dict_or_path=STAGE3) as outer:

        class Defined(nn.Module):  # defined inside: wrapped through __init_subclass__
            def __init__(self) -> None:
                super().__init__()
                self.w = nn.Parameter(torch.ones(3))

        with Init(config_dict_or_path=STAGE3) as inner, Init(enabled=False):
            a, b = nn.Linear(2, 2), Defined()
        with Init(remote_device="cpu", config_dict_or_path=STAGE3) as other:
            d = nn.Linear(2, 2)  # another offload: its own partitioner
        c = nn.Linear(2, 2)
    assert inner.partitioner is outer.partitioner
    assert other.partitioner is not outer.partitioner
    assert d.weight.ds_partitioner is other.partitioner
    assert all(p.ds_partitioner is outer.partitioner for m in (a, b, c) for p in m.parameters())
    assert nn.Linear.__init__ is original_init and nn.Module.apply is original_apply
    assert "__init_subclass__" not in nn.Module.__dict__
    assert not hasattr(Defined().w, "ds_id") and not hasattr(nn.Linear(2, 2).weight, "ds_id")
    with pytest.raises(RuntimeError, match="innermost first"):
        first, second = Init(), Init()
        first.__enter__()
        second.__enter__()
        try:
            first.__exit__(None, None, None)
        finally:
            second.__exit__(None, None, None)
            first.__exit__(None, None, None)


def test_init_config_errors() -> None:
    with pytest.raises(ConfigError, match="nvme_path"):
        Init(remote_device="nvme")
    with pytest.raises(ConfigError, match="remote_device='gpu'"):
        Init(remote_device="gpu")
    with pytest.raises(ConfigError, match="stage3_param_persistence_threshlod"):
        Init(config_dict_or_path={"zero_optimization": {"stage3_param_persistence_threshlod": 0}})


def test_init_reads_a_json_config_and_decorates(tmp_path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text('{"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}')

    @Init(config_dict_or_path=str(path))
    def build() -> nn.Module:
        return nn.Linear(3, 3)

    assert build().weight.numel() == 0


# --- memory: a model larger than the per-process budget -------------------------------------------

LAYERS, WIDTH = 16, 1024  # 16 x 4 MiB = 64 MiB of fp32 weights
BUDGET = 48 << 20  # bytes of new address space a rank may map while building


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def _build_under_budget_body(rank: int, world_size: int, use_init: bool) -> str:
    import ctypes

    # One malloc arena, so threads do not reserve 64 MiB regions the budget would count.
    ctypes.CDLL(None).mallopt(-8, 1)  # M_ARENA_MAX
    model_bytes = LAYERS * WIDTH * WIDTH * 4
    assert model_bytes > BUDGET
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_vm_size() + BUDGET, hard))
    try:
        with Init(enabled=use_init):
            model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)))
    except (RuntimeError, MemoryError) as exc:
        outcome = f"failed: {str(exc).splitlines()[0][:80]}"
    else:
        held = sum(
            p.ds_tensor.nbytes if hasattr(p, "ds_id") else p.nbytes for p in model.parameters()
        )
        outcome = f"built: {held} bytes held"
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    return outcome


def test_model_larger_than_the_budget_builds_only_under_init() -> None:
    under = run_on_ranks(_build_under_budget_body, 2, use_init=True, fresh=True)
    shard_bytes = LAYERS * WIDTH * WIDTH * 4 // 2
    assert under == [f"built: {shard_bytes} bytes held"] * 2
    without = run_on_ranks(_build_under_budget_body, 2, use_init=False, fresh=True)
    assert all(o.startswith("failed:") for o in without), without
