"""The torch `DeviceMesh` of a layout's `ParallelDims`: the named mesh axes (`MESH_AXES`) plus the
flattened ones the engines address (`dp`, `dp_shard_cp`, `dp_cp`). Worker plane only.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from raytrain_dt.topology.parallel_dims import MESH_AXES, ParallelDims


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """The named mesh, plus flattened `dp` (data loading, loss) and `dp_shard_cp` axes."""
    mesh = init_device_mesh(device_type, dims.shape, mesh_dim_names=MESH_AXES)
    mesh["dp_replicate", "dp_shard"]._flatten(mesh_dim_name="dp")
    mesh["dp_shard", "cp"]._flatten(mesh_dim_name="dp_shard_cp")
    mesh["dp_replicate", "dp_shard", "cp"]._flatten(mesh_dim_name="dp_cp")
    return mesh
