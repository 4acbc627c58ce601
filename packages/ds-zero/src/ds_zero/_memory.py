"""Memory estimators: bytes per rank for model states under each stage, and DeepSpeed's ZeRO-2
and ZeRO-3 estimators with its formulas.

[Note: model-state bytes per parameter]
With ``P`` bytes per model parameter (4 for fp32, 2 for bf16/fp16), ``K`` bytes of optimizer
state per parameter (Adam: 8, its two fp32 moments) and ``N`` data-parallel ranks, one rank holds
(the ZeRO paper's table, as this package implements it):

============  ===========  ==================  =====================================
stage         parameters   gradients           master weights + optimizer state
============  ===========  ==================  =====================================
0             P            P                   (4 + K), or K when P is fp32
1             P            P                   (4 + K) / N
2             P            P / N               (4 + K) / N
============  ===========  ==================  =====================================

Mixed precision Adam (P=2, K=8): 16, 4 + 12/N and 2 + 14/N bytes per parameter; fp32 Adam
(P=4): 16, 8 + 12/N, 4 + 16/N. Stage 0 in fp32 steps the parameters themselves (no master copy),
as DDP. Under ``offload_optimizer`` the master, the optimizer state and an fp32 gradient shard
(4/N) live in host memory and stage 2 keeps no gradient shard on the device. Alignment padding
(at most ``2N - 1`` elements per bucket) and communication buffers come on top.
"""

from __future__ import annotations

import torch

from ds_zero.api import MemoryBreakdown

__all__ = [
    "estimate_model_states",
    "estimate_zero3_model_states",
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
    "model_states_table",
]


def estimate_model_states(
    num_params: int,
    *,
    stage: int,
    world_size: int,
    param_bytes: int = 2,
    optimizer_state_bytes: int = 8,
    offload: bool = False,
) -> MemoryBreakdown:
    """Bytes one rank holds for ``num_params`` parameters (see [Note: model-state bytes per
    parameter]); ``ZeroOptimizer.memory_breakdown()`` measures the same quantities.

    Args:
        num_params: parameters (elements) of the model, padding included if it should count.
        stage: ZeRO stage 0, 1 or 2.
        world_size: data-parallel ranks ``N``.
        param_bytes: bytes per model parameter ``P`` (4 fp32, 2 bf16/fp16).
        optimizer_state_bytes: optimizer state ``K`` per parameter (Adam 8, SGD momentum 4).
        offload: ``offload_optimizer.device`` is cpu (stages 1 and 2).

    Example:
        >>> estimate_model_states(10**9, stage=2, world_size=8).model_states / 10**9
        3.75
    """
    if stage not in (0, 1, 2):
        raise ValueError(f"stage = {stage!r}: expected 0, 1 or 2")
    if offload and stage == 0:
        raise ValueError("offload needs stage 1 or 2")
    n = world_size if stage >= 1 else 1
    shard = num_params // n
    fp32_flat = stage == 0 and param_bytes == 4
    master = 0 if fp32_flat else 4 * shard
    grads = param_bytes * (shard if stage == 2 else num_params)
    if offload:
        grads = (0 if stage == 2 else grads) + 4 * shard
    state = master + optimizer_state_bytes * shard
    return MemoryBreakdown(
        params=param_bytes * num_params,
        grads=grads,
        optimizer_state=state,
        host=4 * shard + state if offload else 0,
    )


def estimate_zero3_model_states(
    num_params: int,
    largest_layer_params: int,
    *,
    world_size: int,
    param_bytes: int = 2,
    optimizer_state_bytes: int = 8,
    offload_optimizer: bool = False,
    offload_param: bool = False,
    reduce_bucket_numel: int = 0,
) -> MemoryBreakdown:
    """Bytes one rank holds at stage 3, as ds-zero lays it out (``ZeroStage3Optimizer.
    memory_breakdown()`` measures the same quantities).

    Each rank keeps ``1/N`` of the parameters (``P/N`` bytes each), an fp32 gradient shard
    (``4/N``), an fp32 master shard (``4/N``, none when the parameters are fp32: the shard is
    the master) and the optimizer's state (``K/N``). On top it gathers one module's parameters
    at a time (``largest_layer_params`` full-size) and reduces through a bucket of
    ``reduce_bucket_numel`` elements (0: counted in the gathered layer). ``offload_optimizer``
    moves the gradient, master and optimizer shards to host memory, ``offload_param`` the
    parameter shards.

    Example:
        >>> estimate_zero3_model_states(10**9, 10**7, world_size=8).model_states / 10**9
        2.25
    """
    n = world_size
    shard = -(-num_params // n)
    master = 0 if param_bytes == 4 else 4 * shard
    params = param_bytes * shard
    grads = 4 * shard
    state = master + optimizer_state_bytes * shard
    host = (grads + state if offload_optimizer else 0) + (params if offload_param else 0)
    bucket = param_bytes * min(reduce_bucket_numel, num_params)
    return MemoryBreakdown(
        params=params,
        grads=grads,
        optimizer_state=state,
        buffers=param_bytes * largest_layer_params + bucket,
        host=host,
    )


def model_states_table(world_size: int, *, optimizer_state_bytes: int = 8) -> str:
    """A Markdown table of model-state bytes per parameter on ``world_size`` ranks (fp32 and
    mixed precision, stages 0-2, with and without CPU offload), split into device and host.

    Example:
        >>> print(model_states_table(8))
    """
    big = world_size * 10**6  # divisible, so the per-parameter figures are exact
    rows = ["| precision | stage | offload | params | grads | master + optim | device | host |"]
    rows.append("|---|---|---|---|---|---|---|---|")
    for label, p in (("fp32", 4), ("bf16/fp16 + fp32 master", 2)):
        for stage in (0, 1, 2):
            for offload in (False, True) if stage else (False,):
                m = estimate_model_states(
                    big,
                    stage=stage,
                    world_size=world_size,
                    param_bytes=p,
                    optimizer_state_bytes=optimizer_state_bytes,
                    offload=offload,
                )
                cells = (m.params, m.grads, m.optimizer_state, m.model_states - m.host, m.host)
                text = " | ".join(f"{c / big:g}" for c in cells)
                rows.append(f"| {label} | {stage} | {'cpu' if offload else 'none'} | {text} |")
    return "\n".join(rows)


def estimate_zero2_model_states_mem_needs(
    total_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int]:
    """DeepSpeed's ZeRO-2 estimate: ``(cpu bytes, gpu bytes)`` per node and per GPU.

    Without offload a GPU holds 16-bit parameters (2) and 18/N more bytes per parameter (16-bit
    and fp32 gradients, fp32 master, Adam's two moments); the CPU needs the fp32 model once per
    GPU to load it. With offload the GPU keeps the 16-bit parameters and the CPU everything
    else, at least 16 bytes per parameter. CPU figures are padded by ``additional_buffer_factor``.

    Example:
        >>> cpu, gpu = estimate_zero2_model_states_mem_needs(10**9, 8, cpu_offload=False)
    """
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu = 2 * total_params
        cpu = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu = 2 * total_params + int(18 * total_params / total_gpus)
        cpu = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu)


def estimate_zero2_model_states_mem_needs_all_cold(
    total_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> str:
    """Print (and return) DeepSpeed's ZeRO-2 estimate table for a hypothetical model size.

    Example:
        >>> _ = estimate_zero2_model_states_mem_needs_all_cold(1_500_000_000, 8)
    """
    nodes = "nodes" if num_nodes > 1 else "node"
    gpus = "GPUs" if num_gpus_per_node > 1 else "GPU"
    lines = [
        "Estimated memory needed for params, optim states and gradients for a:",
        f"HW: Setup with {num_nodes} {nodes}, {num_gpus_per_node} {gpus} per node.",
        f"SW: Model with {int(total_params / 1e6)}M total params.",
        "  per CPU  |  per GPU |   Options",
    ]
    for cpu_offload in (True, False):
        cpu, gpu = estimate_zero2_model_states_mem_needs(
            total_params, num_gpus_per_node, num_nodes, cpu_offload, additional_buffer_factor
        )
        option = "offload_optimizer=cpu " if cpu_offload else "offload_optimizer=none"
        lines.append(f" {cpu / 2**30:7.2f}GB | {gpu / 2**30:6.2f}GB | {option}")
    text = "\n".join(lines)
    print(text)
    return text


def estimate_zero2_model_states_mem_needs_all_live(
    model: torch.nn.Module,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> str:
    """:func:`estimate_zero2_model_states_mem_needs_all_cold` for a real model (shared
    parameters counted once).

    Example:
        >>> _ = estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=8)
    """
    total = sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())
    return estimate_zero2_model_states_mem_needs_all_cold(
        total, num_gpus_per_node, num_nodes, additional_buffer_factor
    )


def _numel(p: torch.nn.Parameter) -> int:
    """Elements of a parameter, also when stage 3 partitioned it (``ds_numel``)."""
    return int(getattr(p, "ds_numel", p.numel()))


def model_to_params(model: torch.nn.Module) -> tuple[int, int]:
    """``(total parameters, parameters of the largest module)`` as DeepSpeed counts them: shared
    parameters once, a module's own parameters (not its children's) as a layer. Works on a
    stage 3 model too (partitioned parameters count their full ``ds_numel``).

    Example:
        >>> model_to_params(torch.nn.Linear(4, 2))
        (10, 10)
    """
    total = sum({id(p): _numel(p) for p in model.parameters()}.values())
    largest = max(
        (sum(_numel(p) for p in m.parameters(recurse=False)) for m in model.modules()), default=0
    )
    return total, largest


def estimate_zero3_model_states_mem_needs(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    cpu_offload_params: bool = True,
    zero_init: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int, int]:
    """DeepSpeed's ZeRO-3 estimate: ``(cpu bytes per node, gpu bytes per GPU, largest layer
    bytes)``, the three values DeepSpeed's function returns.

    A GPU always holds the largest layer gathered in fp32-sized working memory (``4 *
    largest_layer_params``). Without offload it also holds ``18/N`` bytes per parameter (16-bit
    parameter and gradient shards, fp32 master and Adam's moments); with ``offload_optimizer``
    only the 16-bit parameter shard (``2/N``) stays, and with ``offload_param`` too nothing
    does. The CPU holds what was offloaded (18 or 16 bytes per parameter per node), or, when
    the model is built without ``zero.Init``, at least one fp32 copy of the model per GPU of the
    node; figures are padded by ``additional_buffer_factor``.

    Example:
        >>> cpu, gpu, layer = estimate_zero3_model_states_mem_needs(10**9, 10**8, 8)
    """
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        per_param = 18 if cpu_offload_params else 16
        gpu = largest_layer_memory
        if not cpu_offload_params:
            gpu += int(2 * total_params / total_gpus)
        factor = per_param * gpus_factor
        if not zero_init:
            factor = max(4 * num_gpus_per_node, factor)
        cpu = total_params * factor * additional_buffer_factor
    else:
        gpu = largest_layer_memory + int(18 * total_params / total_gpus)
        loaded = largest_layer_params if zero_init else total_params
        cpu = loaded * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu), largest_layer_memory


def estimate_zero3_model_states_mem_needs_all_cold(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> str:
    """Print (and return) DeepSpeed's ZeRO-3 estimate table for a hypothetical model size: one
    row per combination of ``offload_param``, ``offload_optimizer`` and ``zero_init``.

    Example:
        >>> _ = estimate_zero3_model_states_mem_needs_all_cold(13 * 10**9, 325 * 10**6, 8)
    """
    nodes = "nodes" if num_nodes > 1 else "node"
    gpus = "GPUs" if num_gpus_per_node > 1 else "GPU"
    lines = [
        "Estimated memory needed for params, optim states and gradients for a:",
        f"HW: Setup with {num_nodes} {nodes}, {num_gpus_per_node} {gpus} per node.",
        f"SW: Model with {int(total_params / 1e6)}M total params, "
        f"{int(largest_layer_params / 1e6)}M largest layer params.",
        "  per CPU  |  per GPU |   Options",
    ]
    for cpu_offload, cpu_offload_params in ((True, True), (True, False), (False, False)):
        for zero_init in (True, False):
            cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
                total_params,
                largest_layer_params,
                num_gpus_per_node,
                num_nodes,
                cpu_offload,
                cpu_offload_params,
                zero_init,
                additional_buffer_factor,
            )
            options = (
                f"offload_param={'cpu ' if cpu_offload_params else 'none'}, "
                f"offload_optimizer={'cpu ' if cpu_offload else 'none'}, "
                f"zero_init={int(zero_init)}"
            )
            lines.append(f" {cpu / 2**30:7.2f}GB | {gpu / 2**30:6.2f}GB | {options}")
    text = "\n".join(lines)
    print(text)
    return text


def estimate_zero3_model_states_mem_needs_all_live(
    model: torch.nn.Module,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> str:
    """:func:`estimate_zero3_model_states_mem_needs_all_cold` for a real model (counted by
    :func:`model_to_params`, so a model already partitioned by stage 3 works too).

    Example:
        >>> _ = estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=8)
    """
    total, largest = model_to_params(model)
    return estimate_zero3_model_states_mem_needs_all_cold(
        total, largest, num_gpus_per_node, num_nodes, additional_buffer_factor
    )
