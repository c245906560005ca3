"""The layout planner: choose TP, PP, DP split, ZeRO stage, micro-batch and checkpointing.

`plan()` enumerates the layouts the cluster and the pins allow, on every world size worth
trying, prices each with the memory model (`memory.py`) and the step-time model (`cost.py`),
drops those that do not fit (on the accelerator, and in the node's host memory when the
topology knows it: `host_memory.py`), and ranks the rest by estimated step time. It is pure
arithmetic: deterministic, no side effects, and fast enough (well under a second for 405B on
8192 GPUs) to run on every resize.

Rules: TP divides the accelerators per node (TP never leaves NVLink) and the head counts;
PP is a divisor of the layers or a power of two up to them (uneven stages balanced by cost,
`pipeline_stages.py`); the global batch G is kept exactly. Context parallelism (cp ranks share
each sequence; world = tp x cp x pp x dp) is a candidate only where a long sequence makes
memory demand it; expert parallelism (ep of the dp_shard ranks share each MoE block's
experts; no change to the world or the data split) for MoE shapes only, at every ep dividing
both the experts and dp_shard (the degrees: `degree_grid.py`). Where dp divides G each rank
reads G/dp samples; otherwise (pp == 1 only) ranks read slices one sample apart in ceil(G/dp) slots
and the spare slots are zero-weighted padding (`Layout.real_global_batch`, `data.order`,
`engines.micro_loss`), priced as compute. G being fixed, the shortest step is the highest
throughput; within THROUGHPUT_TIE of it fewer accelerators win, then exact layouts. So the math
of the run never changes with the cluster size, and a lost node costs about its share.

With a batch tolerance t (`trainer.batch_tolerance`) the planner may also train a smaller real
batch (1 - t) * G <= G' < G, split exactly (G' = dp x slots), when that fits the ranks better:
1,023 nodes for G = 1,024 at one sample per rank train G' = 1,023 instead of dropping to 512
nodes. Layouts are then ranked by time per sample (per G samples); within THROUGHPUT_TIE of the
best, the largest batch wins first, so G is kept whenever it costs less than the tie.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from raytrain_dt.errors import ConfigError, PlanningError
from raytrain_dt.models.presets import ModelShape
from raytrain_dt.topology.cost import StepTime, compute_s, estimate_step_time
from raytrain_dt.topology.degree_grid import (
    cp_degrees,
    degree_grid,
    divisors,
    dp_splits,
    ep_degrees,
    smallest_batch,
)
from raytrain_dt.topology.host_memory import (
    HostMemoryEstimate,
    host_bytes_per_rank,
    ranks_per_node,
)
from raytrain_dt.topology.layout import Layout, Topology
from raytrain_dt.topology.memory import (
    GB,
    MemoryEstimate,
    estimate_memory,
)
from raytrain_dt.topology.parallel_dims import ParallelDims
from raytrain_dt.topology.pins import LayoutPins, engine_refusal, validate_pins
from raytrain_dt.topology.pipeline_stages import schedule_variants
from raytrain_dt.topology.plan_reasons import alt_reason, best_reason, states_gb
from raytrain_dt.topology.plan_result import Candidate, Plan


@dataclass(frozen=True)
class _Opts:
    global_batch: int  # the configured batch G: times are compared per G samples
    seq_len: int
    precision: str
    margin: float
    mfu: float | None
    max_micro_batch: int
    engine: str
    async_save: bool = True
    memory_copies: bool = False


@dataclass(frozen=True)
class _HostNeed:
    """What a layout's fullest node needs in host memory."""

    layout: Layout
    rank: HostMemoryEstimate
    ranks: int

    @property
    def per_node(self) -> float:
        return self.ranks * self.rank.total


def _host_need(
    shape, layout: Layout, memory: MemoryEstimate, topo: Topology, o: _Opts
) -> _HostNeed:
    device = memory.total if topo.device_memory_on_host else 0.0
    rank = host_bytes_per_rank(
        shape,
        layout,
        engine=o.engine,
        precision=o.precision,
        async_save=o.async_save,
        device_bytes=device,
        memory_copies=o.memory_copies,
    )
    return _HostNeed(layout, rank, ranks_per_node(layout, topo))


def _leaner(a: _HostNeed | None, b: _HostNeed | None) -> _HostNeed | None:
    if a is None or b is None:
        return a or b
    return a if a.per_node <= b.per_node else b


def _enumerate(shape, topo, pins, cells, o: _Opts, allow_offload=False):
    """All fitting candidates of `cells` (`degree_grid`), plus the leanest (lowest memory) seen, and
    the leanest host need of those that fit the accelerator but not the host."""
    fitting: list[Candidate] = []
    leanest: Candidate | None = None
    host_miss: _HostNeed | None = None
    zeros = [pins.zero_stage] if pins.zero_stage is not None else [0, 1, 2, 3]
    ac_pin = pins.activation_checkpointing
    acs = [ac_pin] if ac_pin is not None else [False, True]
    for tp, pp, cp, dp, per_rank, batch in cells:
        world = tp * pp * cp * dp
        real = batch if per_rank * dp != batch else 0  # 0: exact, no padding
        if pins.micro_batch or pins.grad_accum:
            mbs = [pins.micro_batch or per_rank // pins.grad_accum]
        else:
            mbs = [m for m in divisors(per_rank) if m <= o.max_micro_batch]
        # SP costs the same bytes as plain TP and stores less, so it is on whenever TP is.
        sp = tp > 1 and pins.sequence_parallel is not False
        sched, v = (pins.pp_schedule or "1f1b", pins.virtual_stages or 1) if pp > 1 else ("1f1b", 1)
        for zero in zeros:
            if engine_refusal(o.engine, tp, pp, zero, o.precision):
                continue
            offloads = [False, True] if allow_offload and zero > 0 else [False]
            if pins.offload_optimizer is not None:
                offloads = [pins.offload_optimizer]
            splits = dp_splits(dp, zero, tp * cp, topo, pins)
            eps = {split: ep_degrees(shape, split[1], pins) for split in splits}
            choices = [(split, ep) for split in splits for ep in eps[split]]
            for ((dpr, dps), ep), offload, ac in itertools.product(choices, offloads, acs):
                # Sharding over one rank is plain DP with extra steps; it only matters as the
                # vehicle for offload (ZeRO-Offload on a single replica), or where the engine
                # runs no ZeRO-0 without a pipeline (DeepSpeed in bf16: its ZeRO-1 is then the
                # plain replica).
                no_zero0 = pp == 1 and engine_refusal(o.engine, tp, pp, 0, o.precision)
                if (
                    dps == 1
                    and zero > 0
                    and pins.zero_stage is None
                    and not (offload and zero == 1)
                    and not (zero == 1 and no_zero0)
                ):
                    continue
                dims = ParallelDims(
                    world_size=world, pp=pp, dp_replicate=dpr, dp_shard=dps, cp=cp, tp=tp, ep=ep
                )
                for mb in mbs:  # ascending: activations only grow, so stop at the first miss
                    layout = Layout(
                        dims,
                        zero,
                        mb,
                        per_rank // mb,
                        ac,
                        sp,
                        offload,
                        sched,
                        v,
                        real_global_batch=real,
                        pp_layers=(pins.pp_layers or ()) if pp > 1 else (),
                    )
                    kw = {"seq_len": o.seq_len, "precision": o.precision}
                    found = [
                        (lay, estimate_memory(shape, lay, margin=o.margin, engine=o.engine, **kw))
                        for scheduled in schedule_variants(
                            layout, shape.n_layers, pins.pp_schedule, pins.virtual_stages
                        )
                        for lay in _grad_sync_variants(scheduled, pins, o.engine)
                    ]
                    fits = [(lay, m) for lay, m in found if m.total <= topo.memory_per_accelerator]
                    if not found:
                        break
                    if not fits:
                        mem = min((m for _, m in found), key=lambda m: m.total)
                        if leanest is None or mem.total < leanest.memory.total:
                            leanest = Candidate(layout, mem, StepTime(0, 0, 0, 0, 0, 0))
                        break
                    for lay, mem in fits:
                        host = _host_need(shape, lay, mem, topo, o)
                        if topo.host_memory_per_node and host.per_node > topo.host_memory_per_node:
                            host_miss = _leaner(host_miss, host)
                            continue
                        t = estimate_step_time(shape, lay, topo, mfu=o.mfu, **kw)
                        fitting.append(Candidate(lay, mem, t, host_per_node=host.per_node))
    return fitting, leanest, host_miss


def _grad_sync_variants(layout: Layout, pins: LayoutPins, engine: str) -> list[Layout]:
    """`layout` with each gradient-sync choice it allows: deferring the reduce-scatter to the
    final micro-step is a choice only for FSDP2 zero 2/3 with accumulation and no pipeline."""
    if layout.grad_sync_deferred or layout.grad_accum == 1:
        return [layout]
    if engine != "fsdp2":  # DeepSpeed ZeRO-2/3 reduce in backward hooks on every micro-step
        return [] if pins.grad_sync == "final" else [layout]
    deferred = dataclasses.replace(layout, defer_grad_sync=True)
    return {"final": [deferred], "every": [layout]}.get(pins.grad_sync, [deferred, layout])


# Step times within this fraction of the fastest count as a tie (see `plan`).
THROUGHPUT_TIE = 0.01


def _search(shape, topo, pins, cells, o: _Opts, allow_offload=False):
    """`_enumerate` over the cells that can come within THROUGHPUT_TIE of the fastest step.

    Cells are visited by their compute time, a floor on any of their step times; once that
    floor is past the fastest step found (plus the tie band), no later cell can compete.
    """

    def floor(cell):
        tp, pp, cp, _, slots, batch = cell
        compute = compute_s(shape, slots, tp * pp * cp, topo, seq_len=o.seq_len, mfu=o.mfu, tp=tp)
        return compute * o.global_batch / batch

    fitting: list[Candidate] = []
    leanest: Candidate | None = None
    host_miss: _HostNeed | None = None
    fastest = float("inf")
    for bound, cell in sorted(((floor(c), c) for c in cells), key=lambda x: x[0]):
        if bound > fastest * (1 + THROUGHPUT_TIE):
            break
        found, lean, host = _enumerate(shape, topo, pins, [cell], o, allow_offload)
        fitting += found
        fastest = min([fastest] + [per_batch_s(c, o.global_batch) for c in found])
        if lean and (leanest is None or lean.memory.total < leanest.memory.total):
            leanest = lean
        host_miss = _leaner(host_miss, host)
    return fitting, leanest, host_miss


def per_batch_s(c: Candidate, global_batch: int) -> float:
    """Seconds to train `global_batch` samples at this layout: its step time when it trains
    the whole batch, longer when a tolerated smaller batch takes more steps."""
    if c.layout.global_batch == global_batch:
        return c.step_time.total_s
    return c.step_time.total_s * global_batch / c.layout.global_batch


def _rank_key(c: Candidate, global_batch: int):
    lay, d = c.layout, c.layout.dims
    # 6 significant digits: equal-volume collectives computed along different paths tie.
    speed = float(f"{per_batch_s(c, global_batch):.6g}")
    prefs = (d.tp, d.pp, d.cp, lay.zero_stage, lay.activation_checkpointing, -lay.micro_batch)
    return (speed, *prefs, lay.offload_optimizer, d.dp_replicate, not lay.sequence_parallel, d.ep)


def plan(
    shape: ModelShape,
    topology: Topology,
    *,
    global_batch: int,
    seq_len: int,
    pins: LayoutPins | None = None,
    precision: str = "bf16",
    margin: float = 0.10,
    mfu: float | None = None,
    max_micro_batch: int = 16,
    top_k: int = 5,
    engine: str = "fsdp2",
    async_save: bool = True,
    batch_tolerance: float = 0.0,
    memory_copies: bool = False,
    cp_attention: bool = True,
) -> Plan:
    """The fastest fitting layout and up to `top_k` structurally different alternatives.
    `async_save`: checkpoints are staged in host memory (`checkpoint.async_save`);
    `batch_tolerance`: `trainer.batch_tolerance` (the module docstring);
    `memory_copies`: so are in-memory copies of the state (`checkpoint.memory_every_steps`);
    `cp_attention`: the model can run context-parallel attention (not a `model.hf` model)."""
    pins = pins or LayoutPins()
    for key, value in (("trainer.global_batch", global_batch), ("data.seq_len", seq_len)):
        if value < 1:
            raise ConfigError(f"{key}: must be >= 1, got {value}")
    if not 0.0 <= batch_tolerance < 1.0:
        raise ConfigError(f"trainer.batch_tolerance: must be in [0, 1), got {batch_tolerance}")
    validate_pins(shape, topology, pins, global_batch, engine, precision, seq_len, cp_attention)
    if engine == "deepspeed":
        # No tensor, context or expert parallelism; pipelines only with ZeRO-1
        # (`engine_refusal`, in `_enumerate`).
        pins = dataclasses.replace(pins, tp=1, cp=1, ep=1)
    if shape.is_moe:
        # The tensor-parallel plan covers dense blocks only (`model_refusal`).
        pins = dataclasses.replace(pins, tp=1)
    if not cp_attention:
        pins = dataclasses.replace(pins, cp=1)
    n, per_node = topology.num_accelerators, topology.accelerators_per_node
    opts = _Opts(
        global_batch,
        seq_len,
        precision,
        margin,
        mfu,
        max_micro_batch,
        engine,
        async_save,
        memory_copies,
    )
    least = smallest_batch(global_batch, batch_tolerance)
    cps = cp_degrees(shape, topology, pins, seq_len, precision)
    cells = list(degree_grid(shape, topology, pins, global_batch, least, cps))
    if not cells:
        raise PlanningError(
            f"no layout of up to {n} accelerators honours the pins and splits "
            f"trainer.global_batch={global_batch}"
        )
    fitting, leanest, host_miss = _search(shape, topology, pins, cells, opts)
    if not fitting and pins.offload_optimizer is None:
        # Offload is the last resort: the model prices PCIe, CPU Adam and host memory but
        # not CPU contention, so it is only offered when nothing fits without it.
        fitting, leanest, offload_miss = _search(
            shape, topology, pins, cells, opts, allow_offload=True
        )
        host_miss = _leaner(host_miss, offload_miss)
    if not fitting and host_miss is not None:
        raise PlanningError(_host_refusal(shape, topology, host_miss))
    if not fitting:
        need = leanest.memory.total / GB if leanest else float("nan")
        desc = leanest.layout.describe() if leanest else "none"
        desc += " +offload" if leanest and leanest.layout.offload_optimizer else ""
        raise PlanningError(
            f"nothing fits: {shape.num_params / 1e9:.1f}B params on {topology.num_nodes} x "
            f"{per_node} accelerators of {topology.memory_per_accelerator / GB:.0f} GB; the leanest "
            f"layout ({desc}) needs {need:.1f} GB per accelerator"
        )
    ranked = sorted(fitting, key=lambda c: _rank_key(c, global_batch))
    # The shortest time per G samples is the highest throughput (with the exact batch: the
    # shortest step). Within THROUGHPUT_TIE of it, the largest batch wins (the configured one
    # whenever it is in the tie), then fewer accelerators (spares for the next failure), then
    # exact layouts, then the usual order.
    fastest = per_batch_s(ranked[0], global_batch)
    best = min(
        (c for c in ranked if per_batch_s(c, global_batch) <= fastest * (1 + THROUGHPUT_TIE)),
        key=lambda c: (
            -c.layout.global_batch,
            c.layout.dims.world_size,
            c.layout.padded_slots > 0,
            _rank_key(c, global_batch),
        ),
    )
    same_batch = [c for c in fitting if c.layout.global_batch == best.layout.global_batch]
    reason = best_reason(best, same_batch, shape, precision, engine, THROUGHPUT_TIE, seq_len)
    if best.layout.global_batch < global_batch:
        reason = (
            f"trains global batch {best.layout.global_batch} of {global_batch} "
            f"(trainer.batch_tolerance={batch_tolerance:g}): the fastest per sample; {reason}"
        )
    world = best.layout.dims.world_size
    if world < n:
        reason = f"uses {world} of {n} accelerators: more would not be faster; {reason}"
    best = dataclasses.replace(best, reason=reason)
    # Alternatives: the fastest of each other structure, not micro-batch variations of one.
    seen = {_structure(best)}
    alternatives = []
    for c in ranked:
        if len(alternatives) >= top_k:
            break
        if _structure(c) not in seen:
            seen.add(_structure(c))
            alternatives.append(dataclasses.replace(c, reason=alt_reason(c, best)))
    dp, accum = best.layout.dims.dp, best.layout.grad_accum
    states = {
        name: round(states_gb(shape, dp, z, precision, engine, grad_accum=accum), 3)
        for name, z in (("ddp", 0), ("zero1", 1), ("zero2", 2), ("zero3", 3))
    }
    return Plan(best, alternatives, states, len(fitting), topology.memory_per_accelerator / GB)


def _host_refusal(shape: ModelShape, topology: Topology, need: _HostNeed) -> str:
    """One line: layouts fit the accelerators but none the nodes' host memory."""
    desc = need.layout.describe() + (" +offload" if need.layout.offload_optimizer else "")
    return (
        f"nothing fits in host memory: {shape.num_params / 1e9:.1f}B params; the leanest layout "
        f"({desc}) needs {need.per_node / GB:.1f} GB per node ({need.ranks} ranks x "
        f"{need.rank.total / GB:.1f} GB: {need.rank.describe()}) but a node has "
        f"{topology.host_memory_per_node / GB:.1f} GB (cluster.host_memory_gb / --host-mem-gb)"
    )


def _structure(c: Candidate) -> tuple:
    lay = c.layout
    return (
        *lay.dims.shape,
        lay.dims.ep,
        lay.zero_stage,
        lay.activation_checkpointing,
        lay.offload_optimizer,
    )
