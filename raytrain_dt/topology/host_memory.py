"""Host memory model, in bytes: what a rank holds in its node's RAM, and a checkpoint's size.

The accelerator memory model (`memory.py`) prices what a rank holds on its accelerator; this
one prices what it holds beside it, in host memory, where nothing else checks it:

- offloaded states (`engine.offload_optimizer`): FSDP2's CPUOffloadPolicy keeps the rank's
  parameter, gradient and optimizer shards on the host; DeepSpeed's ZeRO-Offload its fp32
  master partition, Adam moments and fp32 gradient partition;
- the staging buffers of async checkpointing (`checkpoint/staging.py`): one host copy of the
  rank's shard of model and optimizer states, pinned on accelerators, kept for the run;
- the in-memory copies (`checkpoint.memory_every_steps`, `worker/peer_copies.py`): its own
  copies are its staging buffers, three sets (the newest two steps held, one being staged),
  and it holds a peer's copies of the newest two steps (`MEMORY_COPY_SHARDS` shards in all);
- the accelerator's own memory where the device is host RAM (cpu, emulated);
- the process itself: torch, Ray's worker, the data iterator (`RANK_PROCESS_HOST_BYTES`).

A node holds its ranks' sum. Also `checkpoint_bytes`: one full checkpoint, for save and load
deadlines and for `raytrain-dt doctor`'s disk check. Pure arithmetic, like `memory.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from raytrain_dt.models.presets import ModelShape
from raytrain_dt.topology.layout import Layout, Topology
from raytrain_dt.topology.memory import (
    GB,
    estimate_memory,
    layout_degrees,
    model_state_bytes,
    resident_bytes_per_param,
    stage_params,
)

# An idle rank actor (a `RankWorker` that has imported torch and its lazy modules, waiting for
# a layout): 0.42-0.48 GB RSS (0.28 GB USS) in two runs of `bench/idle_rank_rss.py` (torch 2.13
# CPU, Ray 2.60, Python 3.11, on the 2-core CI machine); rounded up.
IDLE_RANK_RSS_BYTES = 0.5e9
# A CUDA process adds the CUDA runtime's and libraries' resident pages (cuBLAS, cuDNN, NCCL) to
# that: about 1 GB is usual, but it could not be measured here (no GPU). Assumed.
CUDA_HOST_OVERHEAD_BYTES = 1.0e9
# What every rank process is priced at, whatever its device (conservative on CPU).
RANK_PROCESS_HOST_BYTES = IDLE_RANK_RSS_BYTES + CUDA_HOST_OVERHEAD_BYTES
# The engines that save asynchronously through the staging buffers (those with `save_async`:
# FSDP2; DeepSpeed saves synchronously from its own buffers).
ASYNC_SAVE_ENGINES = ("fsdp2",)
# In-memory copies, in shards of the rank's state: the copier's buffer sets, which are its own
# copies of the newest two steps (`CopyStore.keep`) plus the one being staged, and the copies
# of its peer's newest two steps that it holds.
MEMORY_COPY_SHARDS = 1 + 2 * 2


@dataclass(frozen=True)
class HostMemoryEstimate:
    """Host bytes of one rank, by cause."""

    offload: float
    staging: float
    device: float  # accelerator memory that is host RAM (cpu, emulated devices); 0 on GPUs
    process: float
    memory_copies: float = 0.0  # checkpoint.memory_every_steps: own and peer copies

    @property
    def total(self) -> float:
        return self.offload + self.staging + self.device + self.process + self.memory_copies

    def describe(self) -> str:
        parts = [
            ("offload", self.offload),
            ("checkpoint staging", self.staging),
            ("in-memory copies (checkpoint.memory_every_steps)", self.memory_copies),
            ("device memory", self.device),
            ("process", self.process),
        ]
        return ", ".join(f"{name} {value / GB:.1f}" for name, value in parts if value)


def checkpoint_bytes(
    shape: ModelShape, *, engine: str = "fsdp2", precision: str = "bf16", zero_stage: int = 3
) -> float:
    """Bytes of one full checkpoint of `shape`: every parameter and its optimizer state as the
    engine saves them (FSDP2: fp32 parameters and Adam moments, 12 B/param; DeepSpeed: the
    module in the compute dtype plus fp32 master and moments). The RNG states and the
    train-state record are noise beside them."""
    params, _, optimizer = resident_bytes_per_param(engine, precision, zero_stage, shard=1)
    return shape.num_params * (params + optimizer)


def rank_checkpoint_bytes(
    shape: ModelShape, layout: Layout, *, engine: str = "fsdp2", precision: str = "bf16"
) -> float:
    """The rank's shard of model and optimizer states (what its async save stages): its
    pipeline stage, its TP slice, and its ZeRO/FSDP shard when the states are sharded (over
    dp_shard x cp, its experts over dp_shard/ep: `memory.model_state_bytes`)."""
    params, _, optimizer = model_state_bytes(
        shape, **layout_degrees(layout), precision=precision, engine=engine
    )
    return params + optimizer


def offloaded_bytes(
    shape: ModelShape, layout: Layout, *, engine: str = "fsdp2", precision: str = "bf16"
) -> float:
    """Host bytes of the rank's offloaded states (0 without `offload_optimizer`)."""
    if not layout.offload_optimizer:
        return 0.0
    params, grads, optimizer = model_state_bytes(
        shape, **layout_degrees(layout), precision=precision, engine=engine
    )
    if engine == "fsdp2":  # CPUOffloadPolicy: parameter, gradient and optimizer shards
        return params + grads + optimizer
    # ZeRO-Offload: fp32 master and Adam moments, and the fp32 gradient partition they step on.
    d = layout.dims
    return optimizer + stage_params(shape, d.pp) / d.tp * 4.0 / d.dp_shard


def host_bytes_per_rank(
    shape: ModelShape,
    layout: Layout,
    *,
    engine: str = "fsdp2",
    precision: str = "bf16",
    async_save: bool = True,
    device_bytes: float = 0.0,
    memory_copies: bool = False,
) -> HostMemoryEstimate:
    """Host bytes one rank of `layout` holds. `device_bytes`: its accelerator memory when that
    is host RAM (the accelerator estimate's total on cpu and emulated devices), else 0.
    `memory_copies`: in-memory copies are on (only engines that stage asynchronously take
    them)."""
    shard = rank_checkpoint_bytes(shape, layout, engine=engine, precision=precision)
    stages = engine in ASYNC_SAVE_ENGINES
    return HostMemoryEstimate(
        offload=offloaded_bytes(shape, layout, engine=engine, precision=precision),
        staging=shard if async_save and stages else 0.0,
        device=device_bytes,
        process=RANK_PROCESS_HOST_BYTES,
        memory_copies=MEMORY_COPY_SHARDS * shard if memory_copies and stages else 0.0,
    )


def ranks_per_node(layout: Layout, topology: Topology) -> int:
    """The most ranks of `layout` one node holds (nodes are filled in order)."""
    return min(topology.accelerators_per_node, layout.dims.world_size)


def host_bytes_per_node(
    shape: ModelShape,
    layout: Layout,
    topology: Topology,
    *,
    seq_len: int,
    engine: str = "fsdp2",
    precision: str = "bf16",
    async_save: bool = True,
    margin: float = 0.10,
    memory_copies: bool = False,
) -> float:
    """Host bytes the fullest node of `layout` on `topology` needs: its ranks' sum. Where the
    accelerators' memory is host RAM (`Topology.device_memory_on_host`) it counts too."""
    device = 0.0
    if topology.device_memory_on_host:
        device = estimate_memory(
            shape, layout, seq_len=seq_len, precision=precision, margin=margin, engine=engine
        ).total
    rank = host_bytes_per_rank(
        shape,
        layout,
        engine=engine,
        precision=precision,
        async_save=async_save,
        device_bytes=device,
        memory_copies=memory_copies,
    )
    return ranks_per_node(layout, topology) * rank.total
