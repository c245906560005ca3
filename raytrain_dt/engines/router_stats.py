"""A step's router statistics (`RouterStats`) over the global batch: the MoE layers' counts of
this rank's micro-steps, summed over the ranks that split the batch in one all-reduce."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from raytrain_dt.engines.base import RouterStats
from raytrain_dt.models.moe import take_router_stats


def reduce_router_stats(model: nn.Module, device: torch.device, group) -> RouterStats | None:
    """None for a dense model; `group`: every rank holding distinct tokens of the batch (dp_cp).
    Collective over `group`."""
    counts = take_router_stats(model, device)
    if counts is None:
        return None
    dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    values = counts.tolist()
    return RouterStats(tokens_per_expert=values[:-1], dropped=values[-1])
