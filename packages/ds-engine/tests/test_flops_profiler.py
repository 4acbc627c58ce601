"""``deepspeed.profiling.flops_profiler``: FLOPs and MACs counted at the aten level agree with
``torch.utils.flop_counter.FlopCounterMode`` on the example GPT, per-module attribution, the
report in DeepSpeed's shape, and the engine's ``flops_profiler`` section on 2 ranks."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).parent))
from _engine_testing import config, loss_of, make_dataset, make_mlp

from ds_testing import run_on_ranks

EXAMPLE = Path(__file__).resolve().parents[3] / "tools" / "examples" / "gpt" / "train.py"


def _gpt_module():
    spec = importlib.util.spec_from_file_location("gpt_example_profile", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpt_block_matches_flop_counter_mode() -> None:
    """The matrix products give exactly FlopCounterMode's FLOPs (2 per MAC, same registry);
    the total adds the elementwise work, counted analytically here."""
    from ds_engine.profiling.flops_profiler import get_model_profile

    gpt = _gpt_module()
    b, t, c, heads = 2, 16, 32, 4
    torch.manual_seed(0)
    block = gpt.Block(c, heads).eval()
    x = torch.randn(b, t, c)
    with FlopCounterMode(display=False) as counter:
        block(x)
    flops, macs, params = get_model_profile(block, args=[x], print_profile=False, as_string=False)
    n = b * t
    matmul = 2 * n * c * (3 * c + c + 4 * c + 4 * c)  # qkv, proj, mlp up and down
    matmul += 2 * 2 * b * heads * t * t * (c // heads)  # attention: q k^T and p v
    assert 2 * macs == counter.get_total_flops() == matmul
    bias_adds = n * (3 * c + c + 4 * c + c)
    elementwise = bias_adds + n * 4 * c + 2 * 5 * n * c + 2 * n * c  # + gelu, 2 norms, residuals
    assert flops == matmul + elementwise
    assert params == sum(p.numel() for p in block.parameters())


def test_whole_gpt_matches_flop_counter_mode_and_attributes_modules() -> None:
    from ds_engine.profiling.flops_profiler import FlopsProfiler

    gpt = _gpt_module()
    torch.manual_seed(0)
    model = gpt.GPT(vocab=64, seq=16, dim=32, layers=2, heads=4)
    tokens = torch.randint(0, 64, (2, 17))
    with FlopCounterMode(display=False) as counter:
        model(tokens)
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(tokens)
    prof.stop_profile()
    assert 2 * prof.get_total_macs() == counter.get_total_flops()
    counts = prof._require()
    qkv = model.blocks[0].qkv
    assert counts.flops(qkv) == 2 * 32 * 32 * 96 + 32 * 96  # product + bias
    assert counts.flops(model) == sum(counts.stats[m].flops for m in model.modules())
    assert counts.flops(model.blocks) == 2 * counts.flops(model.blocks[1])
    # the model's own work: embeddings' sum, log_softmax over the logits (cross-entropy)
    assert counts.stats[model].flops == 32 * 32 + 32 * 64
    assert float(prof.get_total_duration()) > 0 and prof.get_total_params() == 28032
    assert str(prof.get_total_flops(as_string=True)).endswith(" M")
    prof.end_profile()
    with pytest.raises(RuntimeError, match="start_profile"):
        prof.get_total_flops()


class _Custom(nn.Module):
    """Operators DeepSpeed's patching does not see: ``@`` on a subclass-free path through
    ``Tensor.__matmul__`` is patched, but ``*``, ``+``, ``rsqrt`` and ``einsum`` spelled as
    operators / unpatched functions are not."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.einsum("bi,ij->bj", x, self.w)
        y = y * torch.rsqrt((y * y).mean(-1, keepdim=True) + 1e-6)
        return F.log_softmax(y + x, dim=-1)


def test_counts_operators_functional_patching_misses() -> None:
    from ds_engine.profiling.flops_profiler import get_model_profile

    x = torch.randn(4, 8)
    flops, macs, _ = get_model_profile(_Custom(), args=[x], print_profile=False, as_string=False)
    assert macs == 4 * 8 * 8
    n = x.numel()
    # einsum (as bmm); y*y, mean, y*r, y+x, log_softmax over every element; +eps and rsqrt
    # over the 4 row means
    assert flops == 2 * macs + 5 * n + 2 * 4


def test_report_shape_and_output_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ds_engine.profiling.flops_profiler import get_model_profile

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    flops, macs, params = get_model_profile(model, input_shape=(4, 8), top_modules=2)
    assert (flops, macs, params) == ("1.68 K", "768 MACs", "212")
    out = capsys.readouterr().out
    for part in (
        "DeepSpeed Flops Profiler",
        "Profile Summary at step 1:",
        "params per GPU:",
        "fwd MACs per GPU:",
        "Aggregated Profile per GPU",
        "depth 0:",
        "Detailed Profile per GPU",
        "(0): Linear(144 = 67.92% Params, 512 MACs = 66.67% MACs,",
        "in_features=8, out_features=16, bias=True)",
    ):
        assert part in out, part
    report = tmp_path / "sub" / "profile.txt"
    get_model_profile(model, input_shape=(4, 8), output_file=str(report), detailed=False)
    text = report.read_text()
    assert "Aggregated Profile" in text and "Detailed Profile" not in text
    assert "DeepSpeed Flops Profiler" not in capsys.readouterr().out
    with pytest.raises(ValueError, match="input_shape"):
        get_model_profile(model)


def test_ignore_list_charges_the_parent() -> None:
    from ds_engine.profiling.flops_profiler import FlopsProfiler

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=[nn.Linear])
    model(torch.randn(2, 4))
    prof.stop_profile()
    counts = prof._require()
    assert counts.stats[model[0]].flops == 0 and counts.stats[model].flops == 2 * 2 * 16 + 8
    assert prof.get_total_flops() == 2 * 2 * 16 + 8 + 8


def _engine_profile_body(rank: int, world_size: int, out_dir: str) -> dict:
    import contextlib
    import io

    import ds_engine

    report = Path(out_dir) / "flops.txt"
    cfg = config(
        wall_clock_breakdown=True,
        zero_optimization={"stage": 1},
        flops_profiler={"enabled": True, "profile_step": 1, "output_file": str(report)},
    )
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        engine, *_ = ds_engine.initialize(model=make_mlp(), config=cfg)
        data = make_dataset(16)
        for step in range(3):
            engine.backward(loss_of(engine, [t[4 * step : 4 * step + 4] for t in data.tensors]))
            engine.step()
    return {
        "enabled": engine.flops_profiler_enabled(),
        "step": engine.flops_profiler_profile_step(),
        "has_profiler": engine.flops_profiler is not None,
        "stdout_report": "Flops Profiler" in stdout.getvalue(),
        "report": report.read_text() if rank == 0 else None,
    }


@pytest.mark.slow  # rank 0 imports torch._dynamo at its first dispatch mode (tens of seconds)
def test_engine_profiles_the_configured_step_on_rank_0(tmp_path: Path) -> None:
    outputs = run_on_ranks(_engine_profile_body, 2, str(tmp_path), timeout=300)
    for out in outputs:
        assert out["enabled"] and out["step"] == 1 and out["has_profiler"]
        assert not out["stdout_report"]  # output_file: nothing on stdout
    text = outputs[0]["report"]
    for part in (
        "Profile Summary at step 2:",
        "world size:                                                             2",
        "batch size per GPU:                                                     4",
        "fwd MACs per GPU:                                                       768 MACs",
        "bwd latency:",
        "step latency:",
        "samples/second:",
        "(0): Linear(144 = 67.92% Params",
    ):
        assert part in text, part
    assert text.count("DeepSpeed Flops Profiler") == 1  # one step profiled, written once
