"""The torch `DeviceMesh` of a layout's `ParallelDims`: the named mesh axes (`MESH_AXES`) plus the
flattened ones the engines address (`dp`, `dp_shard_cp`, `dp_cp`). Worker plane only.

With expert parallelism (ep > 1) dp_shard is built as two axes, ("dp_shard_mod_ep", "ep") with
ep innermost (`ParallelDims.ep_groups`: ep consecutive dp_shard indices), and flattened back
into `dp_shard`, so every name above means what it means without ep. The experts' own FSDP
mesh is ("dp_replicate", "dp_shard_mod_ep") (`expert_fsdp_mesh`).
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from raytrain_dt.topology.parallel_dims import MESH_AXES, ParallelDims


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """The named mesh, plus flattened `dp` (data loading, loss) and `dp_shard_cp` axes."""
    if not dims.ep_enabled:
        mesh = init_device_mesh(device_type, dims.shape, mesh_dim_names=MESH_AXES)
        mesh["dp_replicate", "dp_shard"]._flatten(mesh_dim_name="dp")
        mesh["dp_shard", "cp"]._flatten(mesh_dim_name="dp_shard_cp")
        mesh["dp_replicate", "dp_shard", "cp"]._flatten(mesh_dim_name="dp_cp")
        return mesh
    names = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "cp", "tp")
    shape = (dims.pp, dims.dp_replicate, dims.dp_shard_mod_ep, dims.ep, dims.cp, dims.tp)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    mesh["dp_shard_mod_ep", "ep"]._flatten(mesh_dim_name="dp_shard")
    mesh["dp_replicate", "dp_shard_mod_ep", "ep"]._flatten(mesh_dim_name="dp")
    mesh["dp_shard_mod_ep", "ep", "cp"]._flatten(mesh_dim_name="dp_shard_cp")
    mesh["dp_replicate", "dp_shard_mod_ep", "ep", "cp"]._flatten(mesh_dim_name="dp_cp")
    return mesh


def expert_fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh experts' parameters are FSDP-sharded (and replicated) over under ep > 1. Not
    over cp: a mesh of experts' DTensors lists its axes in the root mesh's order, and cp comes
    after ep there; the cp ranks' expert gradients are summed by the engine instead."""
    return mesh["dp_replicate", "dp_shard_mod_ep"]
