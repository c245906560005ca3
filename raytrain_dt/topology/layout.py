"""What the planner decides and what it decides from: `Topology` in, `Layout` out.

Both are frozen, plain data with no torch or Ray in them, so the coordinator can compare,
log and store them, and the simulator can create millions of them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from raytrain_dt.topology.parallel_dims import ParallelDims


@dataclass(frozen=True)
class Topology:
    """The cluster as the planner sees it. Bandwidths in bytes/s, memory in bytes."""

    num_nodes: int
    accelerators_per_node: int
    memory_per_accelerator: float = 80e9
    peak_flops: float = 989e12  # dense bf16 per accelerator (H100 SXM)
    intra_node_bandwidth: float = 450e9  # NVLink, per direction
    inter_node_bandwidth: float = 50e9  # 400 Gb/s NIC per accelerator
    intra_node_latency: float = 5e-6
    inter_node_latency: float = 20e-6

    @property
    def num_accelerators(self) -> int:
        return self.num_nodes * self.accelerators_per_node


@dataclass(frozen=True)
class Layout:
    """A complete parallel layout: who holds what, and how the global batch is cut."""

    dims: ParallelDims
    # 0 = plain data parallel (replicated states), 1/2/3 = ZeRO stage / FSDP sharding.
    zero_stage: int
    micro_batch: int
    grad_accum: int
    activation_checkpointing: bool = False
    sequence_parallel: bool = False
    offload_optimizer: bool = False
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.dims.dp

    def describe(self) -> str:
        return (
            f"{self.dims.describe()} zero={self.zero_stage} micro_batch={self.micro_batch} "
            f"grad_accum={self.grad_accum}"
            + (" +ac" if self.activation_checkpointing else "")
            + (" +sp" if self.sequence_parallel else "")
        )

    def as_dict(self) -> dict:
        record = asdict(self)
        record["dims"] = self.dims.as_dict()
        return record

    @classmethod
    def from_dict(cls, record: dict) -> Layout:
        record = dict(record)
        return cls(dims=ParallelDims(**record.pop("dims")), **record)
