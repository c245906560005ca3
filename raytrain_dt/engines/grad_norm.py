"""The gradient norm over every shard and pipeline stage, and clipping to it, computed on each
rank's local shards.

Taken on DTensors, the norm's foreach ops go through DTensor's sharding propagation, which
every new layout computes afresh (as for the optimizer: `engines/optim.py`), on the path of the
first step after each re-formation. The local form needs no propagation: a shard's squared
norm is summed over the mesh dimensions its gradient is sharded on (replicas are not added
twice), then over the pipeline's stages. A gradient still `Partial` over some dimension (its
shards are addends, not pieces), or with a placement not known here, is taken as a DTensor,
which reduces it first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

from raytrain_dt.accel.device import DeviceSpec
from raytrain_dt.models.materialize import local_shard


def clip_gradients(parameters, max_norm: float, device: DeviceSpec, pp_group=None) -> float:
    """Total gradient norm over all shards and pipeline stages; clips in place if max_norm > 0.
    The norm is fp32 on the compute device (it enters the all-reduces)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    total_sq = device.scalar()
    # (mesh, dims to sum over) -> local gradients; plain tensors have neither. Meshes differ
    # where expert parallelism gives the experts one of their own.
    pieces: dict[tuple, list[torch.Tensor]] = {}
    partial: list[DTensor] = []
    for grad in grads:
        if not isinstance(grad, DTensor):
            pieces.setdefault((None, ()), []).append(grad)
        elif not all(p.is_replicate() or _is_piece(p) for p in grad.placements):
            partial.append(grad)
        else:
            dims = tuple(d for d, p in enumerate(grad.placements) if not p.is_replicate())
            pieces.setdefault((grad.device_mesh, dims), []).append(local_shard(grad))
    for (mesh, dims), local in pieces.items():
        norms = torch._foreach_norm(local, 2.0)
        square = torch.stack([n.float() for n in norms]).square().sum()
        for dim in dims:
            dist.all_reduce(square, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))
        total_sq = total_sq + square
    if partial:
        norm = torch.nn.utils.get_total_norm(partial, norm_type=2.0, foreach=True)
        total_sq = total_sq + norm.full_tensor().float().square()
    if pp_group is not None:
        # Stages hold disjoint parameters: squared norms add up across the pipeline.
        dist.all_reduce(total_sq, op=dist.ReduceOp.SUM, group=pp_group)
    total = total_sq.sqrt()
    if max_norm > 0:
        # As torch.nn.utils.clip_grads_with_norm_, on the local shards.
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for group in _by_device_and_dtype([local_shard(g) for g in grads]):
            torch._foreach_mul_(group, coef.to(group[0].device))
    return float(total)


def _is_piece(placement) -> bool:
    """Each rank holds a disjoint piece along this dimension. FSDP2 shards a tensor-parallel
    dimension-0 shard again with `_StridedShard`, which (torch 2.13) is not `is_shard()`."""
    return placement.is_shard() or isinstance(placement, _StridedShard)


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[tuple, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    return list(groups.values())
