"""The engines' side of mixture-of-experts models: the layouts they train under, each row's
weight in the load-balancing loss, and a step's router statistics over the global batch."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from raytrain_dt.accel.device import DeviceSpec
from raytrain_dt.engines.base import RouterStats
from raytrain_dt.models.moe import moe_layers, take_router_stats
from raytrain_dt.parallel.expert_parallel import expert_modules, num_experts
from raytrain_dt.topology.layout import Layout


def check_moe_layout(model: nn.Module, model_name: str, layout: Layout) -> None:
    """The layouts MoE models train under: expert, data, pipeline and context parallelism,
    FSDP, activation checkpointing; not tensor parallelism."""
    dims = layout.dims
    if dims.ep_enabled and not expert_modules(model):
        raise ValueError(
            f"parallel.ep: model {model_name!r} has no experts to split (ep > 1 needs a "
            "mixture-of-experts model: model.n_experts > 0, such as the moe-tiny preset, or a "
            "Mixtral / Qwen-MoE model.hf)"
        )
    for experts in expert_modules(model):
        if num_experts(experts) % dims.ep:
            raise ValueError(
                f"parallel.ep: {dims.ep} does not divide model.n_experts={num_experts(experts)}"
            )
    # The tensor-parallel plan knows nothing of the experts.
    if moe_layers(model) and dims.tp_enabled:
        raise ValueError(
            f"parallel.tp: mixture-of-experts models train with tp=1 (got tp={dims.tp}); "
            "their experts are split by parallel.ep"
        )


def aux_row_weights(
    layout: Layout, real: torch.Tensor | None, rows: int, device: DeviceSpec
) -> torch.Tensor:
    """Each row's weight in a micro-step's load-balancing loss: dp / global batch for a real
    row (0 for padding), so that, with the gradient's average over DP, every sample of the
    global batch weighs 1/G, as in the single-process mean (the loss is not divided by the
    accumulation count: its gradient is added outside the scaled loss, `models.moe`)."""
    per_row = layout.dims.dp / layout.global_batch
    if real is None or not layout.padded_slots:
        return torch.full((rows,), per_row, device=device.torch_device)
    return device.to_device(real.float() * per_row)


def reduce_router_stats(
    model: nn.Module, n_experts: int, forwards: int, device: torch.device, group, pp_group=None
) -> RouterStats:
    """This step's routing over the global batch: each MoE layer's last `forwards` training
    forwards (the step's micro-batches). `group`: every rank holding distinct tokens of the
    batch (dp_cp), one all-reduce over it; `pp_group`: the pipeline, whose stages hold
    different MoE layers (a second one)."""
    counts = take_router_stats(model, device, n_experts, forwards)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    if pp_group is not None:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=pp_group)
    values = counts.tolist()
    return RouterStats(tokens_per_expert=values[:-1], dropped=values[-1])
