"""What the planner decides and what it decides from: `Topology` in, `Layout` out.

Both are frozen, plain data with no torch or Ray in them, so the coordinator can compare,
log and store them, and the simulator can create millions of them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from raytrain_dt.topology.parallel_dims import ParallelDims

# A CPU core's fp32 matmul rate is of this order: the peak of CPU ranks, for the planner (where
# only the ratios between layouts matter) and for MFU (`observe/mfu.py`).
CPU_PEAK_FLOPS = 1e11


def rank_slice(global_batch: int, dp: int, dp_rank: int) -> tuple[int, int]:
    """[start, stop) within each step's global batch that DP rank `dp_rank` of `dp` reads."""
    return dp_rank * global_batch // dp, (dp_rank + 1) * global_batch // dp


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
    # Accelerators usable in all when the last node is only partly used (e.g. 3 ranks on nodes
    # of 2); 0: every accelerator of every node.
    accelerators: int = 0
    # Host memory of the smallest node; 0: unknown, and the planner does not check it.
    host_memory_per_node: float = 0.0
    # The accelerators' memory is host RAM (cpu and emulated devices): a node's host needs
    # include it.
    device_memory_on_host: bool = False

    @property
    def num_accelerators(self) -> int:
        return self.accelerators or self.num_nodes * self.accelerators_per_node


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
    # FSDP2 zero 2/3 only: reduce-scatter at the final micro-step instead of every one.
    defer_grad_sync: bool = False
    # Samples per step when fewer than the batch slots (micro_batch * grad_accum * dp): the
    # ranks then read uneven slices and the rest of their slots are zero-weighted padding
    # (`data.order.rank_rows`). 0 means every slot holds a sample, as in older records.
    real_global_batch: int = 0
    # Blocks per pipeline stage (pp x virtual_stages of them) when `parallel.pp_layers` pins
    # the split; () means the balanced split (`pipeline_stages.stage_layer_counts`).
    pp_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # A JSON record gives a list; the layout stays hashable.
        object.__setattr__(self, "pp_layers", tuple(self.pp_layers))
        if self.real_global_batch == self.batch_slots:  # one spelling of "no padding"
            object.__setattr__(self, "real_global_batch", 0)
        g, dp, per_rank = self.real_global_batch, self.dims.dp, self.micro_batch * self.grad_accum
        if (g and not dp <= g < self.batch_slots) or -(-g // dp) > per_rank:
            raise ValueError(
                f"real_global_batch={g} must leave every one of dp={dp} ranks between 1 and "
                f"micro_batch x grad_accum = {per_rank} samples"
            )

    @property
    def grad_sync_deferred(self) -> bool:
        """Whether gradients accumulate unreduced until the final micro-step: always at zero
        0/1 and under a pipeline schedule, by choice (`defer_grad_sync`) at zero 2/3."""
        return self.zero_stage <= 1 or self.dims.pp > 1 or self.defer_grad_sync

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step: what the data order, the ledger and throughput count."""
        return self.real_global_batch or self.batch_slots

    @property
    def batch_slots(self) -> int:
        """Rows per step over all DP ranks, padding included: what the engines' shapes see."""
        return self.micro_batch * self.grad_accum * self.dims.dp

    @property
    def padded_slots(self) -> int:
        return self.batch_slots - self.global_batch

    def describe(self) -> str:
        return (
            f"{self.dims.describe()} zero={self.zero_stage} micro_batch={self.micro_batch} "
            f"grad_accum={self.grad_accum}"
            + (" +ac" if self.activation_checkpointing else "")
            + (" +sp" if self.sequence_parallel else "")
            + (" +deferred-sync" if self.defer_grad_sync else "")
            + (f" v={self.virtual_stages}" if self.virtual_stages > 1 else "")
            + (f" pp_layers={list(self.pp_layers)}" if self.pp_layers else "")
            + (
                f" global_batch={self.global_batch} (+{self.padded_slots} padded)"
                if self.padded_slots
                else ""
            )
        )

    def as_dict(self) -> dict:
        """The layout as JSON holds it (events, layout.json): so a record read back from a file
        equals one made here (`pp_layers` a list, not a tuple)."""
        record = asdict(self)
        record["dims"] = self.dims.as_dict()
        record["pp_layers"] = list(self.pp_layers)
        return record

    @classmethod
    def from_dict(cls, record: dict) -> Layout:
        record = dict(record)
        return cls(dims=ParallelDims(**record.pop("dims")), **record)
