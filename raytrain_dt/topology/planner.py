"""The layout planner: choose TP, PP, DP split, ZeRO stage, micro-batch and checkpointing.

`plan()` enumerates every layout the cluster and the pins allow, prices each with the memory
model (`memory.py`) and the step-time model (`cost.py`), drops those that do not fit, and
ranks the rest by estimated step time. It is pure arithmetic: deterministic, no side effects,
and fast enough (well under a second for 405B on 8192 GPUs) to run on every resize.

Rules: TP divides the accelerators per node (TP never leaves NVLink) and the head counts;
PP divides the layers; the global batch is kept exactly (micro_batch * grad_accum * dp). The
plan uses every accelerator; only when *no* layout at full size can keep the global batch
exactly (dp must divide it) does it fall back to the largest smaller world that can - whole
nodes first, then partial nodes - so the math of the run never changes with the cluster size.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

from raytrain_dt.errors import ConfigError, PlanningError
from raytrain_dt.models.presets import ModelShape
from raytrain_dt.topology.cost import StepTime, estimate_step_time
from raytrain_dt.topology.layout import Layout, Topology
from raytrain_dt.topology.memory import (
    GB,
    MemoryEstimate,
    estimate_memory,
    model_state_bytes,
    working_state_bytes,
)
from raytrain_dt.topology.parallel_dims import ParallelDims


@dataclass(frozen=True)
class LayoutPins:
    """Choices fixed by the user; None means the planner decides."""

    tp: int | None = None
    pp: int | None = None
    dp_replicate: int | None = None
    dp_shard: int | None = None
    zero_stage: int | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None
    activation_checkpointing: bool | None = None
    offload_optimizer: bool | None = None
    sequence_parallel: bool | None = None
    pp_schedule: str | None = None
    virtual_stages: int | None = None
    grad_sync: str | None = None  # final / every; None: the planner chooses

    @classmethod
    def from_config(cls, cfg) -> LayoutPins:
        """Pins from a `TrainConfig`. Boolean switches default to False in the config, so only
        True pins them; False leaves the choice to the planner."""
        p, e, t = cfg.parallel, cfg.engine, cfg.trainer
        flag = {
            "activation_checkpointing": t.activation_checkpointing,
            "offload_optimizer": e.offload_optimizer,
        }
        return cls(
            tp=p.tp, pp=p.pp, dp_replicate=p.dp_replicate, dp_shard=p.dp_shard,
            zero_stage=e.zero_stage, micro_batch=t.micro_batch, grad_accum=t.grad_accum,
            pp_schedule=p.pp_schedule, virtual_stages=p.virtual_stages,
            grad_sync=None if e.grad_sync == "auto" else e.grad_sync,
            # Pinned both ways: a layout may only claim sequence parallelism the engine applies.
            sequence_parallel=p.sequence_parallel,
            **{k: True if v else None for k, v in flag.items()},
        )  # fmt: skip


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: MemoryEstimate
    step_time: StepTime
    reason: str = ""


@dataclass
class Plan:
    best: Candidate
    alternatives: list[Candidate]
    # Context for reports: model states per rank at the best layout's DP degree and
    # accumulation, TP = PP = 1, as the planned engine holds them at their peak.
    model_states_gb: dict[str, float] = field(default_factory=dict)
    fitting_layouts: int = 0
    memory_budget_gb: float = 0.0

    def to_json(self) -> dict:
        record = _candidate_json(self.best)
        record["model_state_gb_per_rank"] = self.model_states_gb
        record["fitting_layouts"] = self.fitting_layouts
        record["memory_budget_gb"] = self.memory_budget_gb
        record["alternatives"] = [_candidate_json(c) for c in self.alternatives]
        return record


_DIMS_KEYS = ("world_size", "pp", "dp", "tp", "dp_replicate", "dp_shard")
_LAYOUT_KEYS = (
    "zero_stage", "micro_batch", "grad_accum", "global_batch", "activation_checkpointing",
    "sequence_parallel", "offload_optimizer", "pp_schedule", "virtual_stages",
)  # fmt: skip


def _candidate_json(c: Candidate) -> dict:
    d, lay = c.layout.dims, c.layout
    gb = c.memory.as_gb()
    return {
        "layout": {
            **{k: getattr(d, k) for k in _DIMS_KEYS},
            **{k: getattr(lay, k) for k in _LAYOUT_KEYS},
        },
        "memory_gb_per_rank": {k: round(v, 3) for k, v in gb.items()},
        "step_time_s": round(c.step_time.total_s, 6),
        "step_time_breakdown_s": {k: round(v, 6) for k, v in c.step_time.as_dict().items()},
        "reason": c.reason,
    }


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


_POSITIVE_PINS = {
    "tp": "parallel.tp", "pp": "parallel.pp", "dp_replicate": "parallel.dp_replicate",
    "dp_shard": "parallel.dp_shard", "micro_batch": "trainer.micro_batch",
    "grad_accum": "trainer.grad_accum", "virtual_stages": "parallel.virtual_stages",
}  # fmt: skip


def engine_refusal(
    engine: str, tp: int | None, pp: int | None, zero_stage: int | None
) -> str | None:
    """Why `engine` cannot run these degrees, as one line naming the config keys; None if it can.

    DeepSpeed runs ZeRO data parallelism here: no tensor parallelism, and no pipeline
    parallelism (DeepSpeed's own pipeline engine allows ZeRO-1 at most, since ZeRO-2/3 would
    reduce or gather gradients and parameters per micro-batch of every stage; ZeRO-1 over
    torch.distributed.pipelining stages is not implemented in this version).
    """
    if engine != "deepspeed":
        return None
    if (tp or 1) > 1:
        return (
            f"parallel.tp: {tp} is not supported with engine.name=deepspeed (ZeRO data "
            "parallelism only); use engine.name=fsdp2 for tensor parallelism"
        )
    if (pp or 1) > 1 and (zero_stage or 0) >= 2:
        return (
            f"engine.zero_stage: {zero_stage} cannot be combined with parallel.pp={pp} under "
            "engine.name=deepspeed: pipeline parallelism allows ZeRO-1 at most"
        )
    if (pp or 1) > 1:
        return (
            f"parallel.pp: {pp} is not supported with engine.name=deepspeed (ZeRO-1 + pipeline "
            "is not implemented); use engine.name=fsdp2 for pipeline parallelism"
        )
    return None


def _validate_pins(
    shape: ModelShape, topo: Topology, pins: LayoutPins, global_batch: int, engine: str
) -> None:
    """ConfigError naming the config key for a pin no layout could honour."""
    for attr, key in _POSITIVE_PINS.items():
        value = getattr(pins, attr)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ConfigError(f"{key}: must be a positive int, got {value!r}")
    per_node, n, gb = topo.accelerators_per_node, topo.num_accelerators, global_batch
    tp, pp, mb, ga, z = pins.tp, pins.pp, pins.micro_batch, pins.grad_accum, pins.zero_stage
    degrees = [(a, getattr(pins, a)) for a in ("tp", "pp", "dp_replicate", "dp_shard")]
    degrees = [(a, v) for a, v in degrees if v is not None]
    product = 1
    for _, v in degrees:
        product *= v
    dp = (pins.dp_replicate or 1) * (pins.dp_shard or 1)
    v, sched = pins.virtual_stages or 1, pins.pp_schedule or "1f1b"
    # (broken, message) in order: the first broken rule is reported.
    rules = [
        (tp and per_node % tp,
         f"parallel.tp: {tp} does not divide cluster accelerators per node ({per_node})"),
        (tp and shape.n_heads % tp, f"parallel.tp: {tp} does not divide model.n_heads ({shape.n_heads})"),
        (tp and shape.n_kv_heads % tp,
         f"parallel.tp: {tp} does not divide model.n_kv_heads ({shape.n_kv_heads})"),
        (pp and shape.n_layers % pp, f"parallel.pp: {pp} does not divide model.n_layers ({shape.n_layers})"),
        (product > n, f"parallel.{degrees[-1][0] if degrees else 'tp'}: "
         + " x ".join(f"{a}({v})" for a, v in degrees) + f" = {product} exceeds the cluster's {n} accelerators"),
        (z not in (None, 0, 1, 2, 3), f"engine.zero_stage: {z!r} is not one of 0, 1, 2, 3"),
        (z == 0 and (pins.dp_shard or 1) > 1,
         f"engine.zero_stage: 0 (plain DP) needs parallel.dp_shard=1, got {pins.dp_shard}"),
        (z == 0 and pins.offload_optimizer, "engine.offload_optimizer: needs engine.zero_stage >= 1, got 0"),
        (mb and gb % mb, f"trainer.micro_batch: {mb} does not divide trainer.global_batch ({gb})"),
        (ga and gb % ga, f"trainer.grad_accum: {ga} does not divide trainer.global_batch ({gb})"),
        (mb and ga and gb % (mb * ga), f"trainer.grad_accum: micro_batch({mb}) x grad_accum({ga}) "
         f"does not divide trainer.global_batch ({gb})"),
        (pins.dp_replicate and pins.dp_shard and gb % dp,
         f"parallel.dp_shard: dp = {dp} does not divide trainer.global_batch ({gb})"),
        (v > 1 and sched != "interleaved",
         f"parallel.virtual_stages: {v} needs parallel.pp_schedule=interleaved, got {sched}"),
    ]  # fmt: skip
    for broken, message in rules:
        if broken:
            raise ConfigError(message)
    refusal = engine_refusal(engine, tp, pp, z)
    if refusal:
        raise ConfigError(refusal)


def _grid(shape, topo, pins, world, global_batch):
    """(tp, pp, dp) triples for `world` that honour the pins and keep the global batch."""
    v = pins.virtual_stages or 1
    heads = (shape.n_heads, shape.n_kv_heads)
    tps = [t for t in _divisors(topo.accelerators_per_node) if not any(h % t for h in heads)]
    pps = [p for p in _divisors(shape.n_layers) if p == 1 or shape.n_layers % (p * v) == 0]
    tps, pps = [pins.tp] if pins.tp else tps, [pins.pp] if pins.pp else pps
    for tp, pp in itertools.product(tps, pps):
        if world % (tp * pp):
            continue
        dp = world // (tp * pp)
        if global_batch % dp:
            continue
        if pins.dp_replicate and pins.dp_shard and pins.dp_replicate * pins.dp_shard != dp:
            continue
        if any(x and dp % x for x in (pins.dp_replicate, pins.dp_shard)):
            continue
        per_rank = global_batch // dp
        if any(x and per_rank % x for x in (pins.micro_batch, pins.grad_accum)):
            continue
        if pins.micro_batch and pins.grad_accum and pins.micro_batch * pins.grad_accum != per_rank:
            continue
        yield tp, pp, dp


def _dp_splits(dp, zero, tp, topo, pins):
    """(dp_replicate, dp_shard) pairs: replicate for zero 0, shard for ZeRO, and for zero 3
    HSDP (shard inside a node, replicate across nodes) when the DP group spans nodes."""
    if pins.dp_replicate or pins.dp_shard:
        r = pins.dp_replicate or dp // pins.dp_shard
        s = dp // r
        return [] if (zero == 0 and s > 1) else [(r, s)]
    if zero == 0:
        return [(dp, 1)]
    splits = [(1, dp)]
    inner = topo.accelerators_per_node // tp
    if zero == 3 and 1 < inner < dp and dp % inner == 0:
        splits.append((dp // inner, inner))
    return splits


@dataclass(frozen=True)
class _Opts:
    global_batch: int
    seq_len: int
    precision: str
    margin: float
    mfu: float
    max_micro_batch: int
    engine: str


def _enumerate(shape, topo, pins, world, o: _Opts, allow_offload=False):
    """All fitting candidates for `world`, plus the leanest (lowest memory) layout seen."""
    fitting: list[Candidate] = []
    leanest: Candidate | None = None
    zeros = [pins.zero_stage] if pins.zero_stage is not None else [0, 1, 2, 3]
    ac_pin = pins.activation_checkpointing
    acs = [ac_pin] if ac_pin is not None else [False, True]
    for tp, pp, dp in _grid(shape, topo, pins, world, o.global_batch):
        per_rank = o.global_batch // dp
        if pins.micro_batch or pins.grad_accum:
            mbs = [pins.micro_batch or per_rank // pins.grad_accum]
        else:
            mbs = [m for m in _divisors(per_rank) if m <= o.max_micro_batch]
        # SP costs the same bytes as plain TP and stores less, so it is on whenever TP is.
        sp = tp > 1 and pins.sequence_parallel is not False
        sched, v = (pins.pp_schedule or "1f1b", pins.virtual_stages or 1) if pp > 1 else ("1f1b", 1)
        for zero in zeros:
            offloads = [False, True] if allow_offload and zero > 0 else [False]
            if pins.offload_optimizer is not None:
                offloads = [pins.offload_optimizer]
            splits = _dp_splits(dp, zero, tp, topo, pins)
            for (dpr, dps), offload, ac in itertools.product(splits, offloads, acs):
                # Sharding over one rank is plain DP with extra steps; it only matters as the
                # vehicle for offload (ZeRO-Offload on a single replica).
                if (
                    dps == 1
                    and zero > 0
                    and pins.zero_stage is None
                    and not (offload and zero == 1)
                ):
                    continue
                dims = ParallelDims(world_size=world, pp=pp, dp_replicate=dpr, dp_shard=dps, tp=tp)
                for mb in mbs:  # ascending: activations only grow, so stop at the first miss
                    layout = Layout(dims, zero, mb, per_rank // mb, ac, sp, offload, sched, v)
                    kw = {"seq_len": o.seq_len, "precision": o.precision}
                    found = [
                        (lay, estimate_memory(shape, lay, margin=o.margin, engine=o.engine, **kw))
                        for lay in _grad_sync_variants(layout, pins, o.engine)
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
                        t = estimate_step_time(shape, lay, topo, mfu=o.mfu, **kw)
                        fitting.append(Candidate(lay, mem, t))
    return fitting, leanest


def _grad_sync_variants(layout: Layout, pins: LayoutPins, engine: str) -> list[Layout]:
    """`layout` with each gradient-sync choice it allows: deferring the reduce-scatter to the
    final micro-step is a choice only for FSDP2 zero 2/3 with accumulation and no pipeline."""
    if layout.grad_sync_deferred or layout.grad_accum == 1:
        return [layout]
    if engine != "fsdp2":  # DeepSpeed ZeRO-2/3 reduce in backward hooks on every micro-step
        return [] if pins.grad_sync == "final" else [layout]
    deferred = dataclasses.replace(layout, defer_grad_sync=True)
    return {"final": [deferred], "every": [layout]}.get(pins.grad_sync, [deferred, layout])


def _rank_key(c: Candidate):
    lay, d = c.layout, c.layout.dims
    # 6 significant digits: equal-volume collectives computed along different paths tie.
    speed = float(f"{c.step_time.total_s:.6g}")
    prefs = (d.tp, d.pp, lay.zero_stage, lay.activation_checkpointing, -lay.micro_batch)
    return (speed, *prefs, lay.offload_optimizer, d.dp_replicate, not lay.sequence_parallel)


def _states_gb(shape, dp, zero, precision, engine, tp=1, pp=1, grad_accum=1) -> float:
    """Model states per rank at their peak within a step, as `engine` holds them."""
    kw = {"tp": tp, "pp": pp, "shard": dp, "zero_stage": zero, "precision": precision}
    working = working_state_bytes(shape, **kw, engine=engine, grad_accum=grad_accum)
    return (sum(model_state_bytes(shape, **kw, engine=engine)) + sum(working)) / GB


def _best_reason(best: Candidate, fitting: list[Candidate], shape, precision, engine) -> str:
    lay, d = best.layout, best.layout.dims
    parts = [
        f"fastest estimated step ({best.step_time.total_s:.3g} s) among {len(fitting)} fitting layouts"
    ]
    z = lay.zero_stage
    if z == 0:
        parts.append(
            f"plain DP fits (model states {_states_gb(shape, d.dp, 0, precision, engine, d.tp, d.pp):.1f} GB/rank)"
        )
    else:
        lower = [
            c
            for c in fitting
            if c.layout.zero_stage < z and c.layout.dims.tp == d.tp and c.layout.dims.pp == d.pp
        ]
        if lower:
            gap = min(c.step_time.total_s for c in lower) - best.step_time.total_s
            parts.append(f"zero={z} beats zero<{z} by {gap:.3g} s")
        else:
            need = _states_gb(shape, d.dp_shard, z - 1, precision, engine, d.tp, d.pp)
            parts.append(
                f"model states {need:.1f} GB/rank at zero={z - 1} leave no room; zero>={z} needed"
            )
    if d.tp > 1 or d.pp > 1:
        pure = [c for c in fitting if c.layout.dims.tp == 1 and c.layout.dims.pp == 1]
        where = f"tp={d.tp} within a node, pp={d.pp}"
        if pure:
            gap = min(c.step_time.total_s for c in pure) - best.step_time.total_s
            parts.append(f"{where} is {gap:.3g} s faster than data parallelism alone")
        else:
            parts.append(f"{where}: no data-parallel-only layout fits")
    if lay.activation_checkpointing:
        parts.append("activation checkpointing trades 1/3 more compute for memory")
    return "; ".join(parts)


def _alt_reason(c: Candidate, best: Candidate) -> str:
    delta = c.step_time.total_s - best.step_time.total_s
    if float(f"{delta:.6g}") <= 1e-9 * max(1.0, best.step_time.total_s):
        return (
            "ties with the best; tie-break prefers smaller tp, pp, zero, no AC, larger micro_batch"
        )
    diffs = {
        k: v - best.step_time.as_dict()[k]
        for k, v in c.step_time.as_dict().items()
        if k not in ("total_s", "dp_hidden_s")
    }
    worst = max(diffs, key=lambda k: diffs[k])
    return (
        f"{delta:+.3g} s ({100 * delta / best.step_time.total_s:+.0f}%) vs best, "
        f"mostly {worst.removesuffix('_s')} ({diffs[worst]:+.3g} s)"
    )


def plan(
    shape: ModelShape,
    topology: Topology,
    *,
    global_batch: int,
    seq_len: int,
    pins: LayoutPins | None = None,
    precision: str = "bf16",
    margin: float = 0.10,
    mfu: float = 0.45,
    max_micro_batch: int = 16,
    top_k: int = 5,
    engine: str = "fsdp2",
) -> Plan:
    """The fastest fitting layout and up to `top_k` structurally different alternatives."""
    pins = pins or LayoutPins()
    for key, value in (("trainer.global_batch", global_batch), ("data.seq_len", seq_len)):
        if value < 1:
            raise ConfigError(f"{key}: must be >= 1, got {value}")
    _validate_pins(shape, topology, pins, global_batch, engine)
    if engine == "deepspeed":
        # Only data parallelism is left to choose (see `engine_refusal`).
        pins = dataclasses.replace(pins, tp=1, pp=1)
    n, per_node = topology.num_accelerators, topology.accelerators_per_node
    fixed = [pins.tp, pins.pp, pins.dp_replicate, pins.dp_shard]
    if all(fixed):
        worlds: Iterable[int] = [fixed[0] * fixed[1] * fixed[2] * fixed[3]]
    else:  # all accelerators, then whole nodes, then partial nodes, largest first
        partial = (w for w in range(n - 1, 0, -1) if w % per_node)
        worlds = itertools.chain([n], range(n - per_node, 0, -per_node), partial)
    opts = _Opts(global_batch, seq_len, precision, margin, mfu, max_micro_batch, engine)
    for world in worlds:
        if next(_grid(shape, topology, pins, world, global_batch), None) is None:
            continue  # nothing here keeps the global batch exactly: try a smaller world
        fitting, leanest = _enumerate(shape, topology, pins, world, opts)
        if not fitting and pins.offload_optimizer is None:
            # Offload is the last resort: the model prices PCIe and CPU Adam but not host
            # memory or CPU contention, so it is only offered when nothing fits without it.
            fitting, leanest = _enumerate(shape, topology, pins, world, opts, allow_offload=True)
        break
    else:
        raise PlanningError(
            f"no layout of up to {n} accelerators honours the pins and keeps "
            f"trainer.global_batch={global_batch} exactly"
        )
    if not fitting:
        need = leanest.memory.total / GB if leanest else float("nan")
        desc = leanest.layout.describe() if leanest else "none"
        desc += " +offload" if leanest and leanest.layout.offload_optimizer else ""
        raise PlanningError(
            f"nothing fits: {shape.num_params / 1e9:.1f}B params on {topology.num_nodes} x "
            f"{per_node} accelerators of {topology.memory_per_accelerator / GB:.0f} GB; the leanest "
            f"layout ({desc}) needs {need:.1f} GB per accelerator"
        )
    ranked = sorted(fitting, key=_rank_key)
    best = ranked[0]
    reason = _best_reason(best, fitting, shape, precision, engine)
    if world < n:
        reason = (
            f"uses {world} of {n} accelerators: no layout of all {n} keeps "
            f"global_batch={global_batch} exactly; {reason}"
        )
    best = Candidate(best.layout, best.memory, best.step_time, reason)
    # Alternatives: the fastest of each other structure, not micro-batch variations of one.
    seen = {_structure(best)}
    alternatives = []
    for c in ranked[1:]:
        if len(alternatives) >= top_k:
            break
        if _structure(c) not in seen:
            seen.add(_structure(c))
            alternatives.append(Candidate(c.layout, c.memory, c.step_time, _alt_reason(c, best)))
    dp, accum = best.layout.dims.dp, best.layout.grad_accum
    states = {
        name: round(_states_gb(shape, dp, z, precision, engine, grad_accum=accum), 3)
        for name, z in (("ddp", 0), ("zero1", 1), ("zero2", 2), ("zero3", 3))
    }
    return Plan(best, alternatives, states, len(fitting), topology.memory_per_accelerator / GB)


def _structure(c: Candidate) -> tuple:
    lay = c.layout
    return (*lay.dims.shape, lay.zero_stage, lay.activation_checkpointing, lay.offload_optimizer)
