"""Why the planner chose what it chose: the one-line reasons of the best layout and of each
alternative, in the terms a practitioner checks (memory that forces sharding, what TP/PP buy
over data parallelism alone, what context and expert parallelism save and cost, how a padded
layout cuts the global batch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from raytrain_dt.topology.cost import HIDDEN_KEYS
from raytrain_dt.topology.layout import Layout, rank_slice
from raytrain_dt.topology.memory import (
    GB,
    STATE_BYTES,
    activation_bytes,
    model_state_bytes,
    working_state_bytes,
)

if TYPE_CHECKING:
    from raytrain_dt.topology.plan_result import Candidate


def states_gb(shape, dp, zero, precision, engine, tp=1, pp=1, grad_accum=1, cp=1, ep=1) -> float:
    """Model states per rank at their peak within a step, as `engine` holds them."""
    kw = {"tp": tp, "pp": pp, "shard": dp, "zero_stage": zero, "precision": precision}
    kw |= {"cp": cp, "ep": ep}
    working = working_state_bytes(shape, **kw, engine=engine, grad_accum=grad_accum)
    return (sum(model_state_bytes(shape, **kw, engine=engine)) + sum(working)) / GB


def best_reason(
    best: Candidate,
    fitting: list[Candidate],
    shape,
    precision,
    engine,
    tie: float,
    seq_len: int = 0,
) -> str:
    lay, d = best.layout, best.layout.dims
    fastest = min(c.step_time.total_s for c in fitting)
    parts = [
        f"fastest estimated step ({best.step_time.total_s:.3g} s) among {len(fitting)} fitting layouts"
        if best.step_time.total_s <= fastest
        else f"estimated step {best.step_time.total_s:.3g} s, within {tie:.0%} of the "
        f"fastest ({fastest:.3g} s) on fewer accelerators, among {len(fitting)} fitting layouts"
    ]
    z = lay.zero_stage
    if z == 0:
        parts.append(
            f"plain DP fits (model states "
            f"{states_gb(shape, d.dp, 0, precision, engine, d.tp, d.pp, cp=d.cp):.1f} GB/rank"
            + (f", sharded over the {d.cp} cp ranks" if d.cp > 1 else "")
            + ")"
        )
    else:
        lower = [
            c for c in fitting if c.layout.zero_stage < z and _degrees(c.layout) == _degrees(lay)
        ]
        if lower:
            gap = min(c.step_time.total_s for c in lower) - best.step_time.total_s
            parts.append(f"zero={z} beats zero<{z} by {gap:.3g} s")
        else:
            need = states_gb(
                shape, d.dp_shard, z - 1, precision, engine, d.tp, d.pp, cp=d.cp, ep=d.ep
            )
            parts.append(
                f"model states {need:.1f} GB/rank at zero={z - 1} leave no room; zero>={z} needed"
            )
    if d.tp > 1 or d.pp > 1:
        pure = [
            c
            for c in fitting
            if c.layout.dims.tp == 1
            and c.layout.dims.pp == 1
            and (c.layout.dims.cp, c.layout.dims.world_size) == (d.cp, d.world_size)
        ]
        where = f"tp={d.tp} within a node, pp={d.pp}"
        if pure:
            gap = min(c.step_time.total_s for c in pure) - best.step_time.total_s
            parts.append(f"{where} is {gap:.3g} s faster than data parallelism alone")
        else:
            parts.append(f"{where}: no data-parallel-only layout fits")
    if d.cp > 1:
        parts.append(cp_reason(best, fitting, shape, precision, seq_len))
    if d.ep > 1:
        parts.append(ep_reason(best, fitting, shape, precision))
    if lay.activation_checkpointing:
        parts.append("activation checkpointing trades 1/3 more compute for memory")
    if lay.padded_slots:
        parts.append(padding_reason(lay))
    return "; ".join(parts)


def _activations_gb(shape, lay: Layout, seq_len: int, precision: str, cp: int) -> float:
    d = lay.dims
    return (
        activation_bytes(
            shape,
            seq_len=seq_len,
            micro_batch=lay.micro_batch,
            tp=d.tp,
            pp=d.pp,
            grad_accum=lay.grad_accum,
            sequence_parallel=lay.sequence_parallel,
            activation_checkpointing=lay.activation_checkpointing,
            precision=precision,
            virtual_stages=lay.virtual_stages,
            pp_layers=lay.pp_layers,
            pp_schedule=lay.pp_schedule,
            cp=cp,
        )
        / GB
    )


def cp_reason(best: Candidate, fitting: list[Candidate], shape, precision, seq_len: int) -> str:
    """Why cp > 1: the activations one sequence needs per rank without it and with it, and what
    the best layout without context parallelism costs (or that none fits)."""
    lay, cp = best.layout, best.layout.dims.cp
    whole = _activations_gb(shape, lay, seq_len, precision, 1)
    split = _activations_gb(shape, lay, seq_len, precision, cp)
    text = (
        f"activations of {lay.micro_batch} x {seq_len}-token sequence(s) need {whole:.3g} GB per "
        f"rank at cp=1; cp={cp} cuts them to {split:.3g} GB"
    )
    rest = [c for c in fitting if c.layout.dims.cp == 1]
    if not rest:
        return text + "; no cp=1 layout fits"
    gap = min(c.step_time.total_s for c in rest) - best.step_time.total_s
    t = best.step_time
    return (
        f"{text}; the fastest cp=1 layout is {gap:.3g} s slower (ring K/V traffic "
        f"{t.cp_comm_s + t.cp_hidden_s:.3g} s, {t.cp_hidden_s:.3g} s of it behind attention)"
    )


def ep_reason(best: Candidate, fitting: list[Candidate], shape, precision) -> str:
    """Why ep > 1: the expert weights a rank gathers per MoE block, and the all-to-alls' cost."""
    d = best.layout.dims
    block = shape.expert_params_per_layer / d.tp * STATE_BYTES[precision][0] / GB
    text = (
        f"ep={d.ep} splits each block's {shape.n_experts} experts over {d.ep} ranks: a rank "
        f"gathers {block / d.ep:.2f} GB of expert weights per block instead of {block:.2f} GB, "
        f"and syncs 1/{d.ep} of the expert gradients; its all-to-alls cost "
        f"{best.step_time.ep_comm_s:.3g} s/step"
    )
    same = [
        c
        for c in fitting
        if c.layout.dims.ep == 1 and _degrees(c.layout)[:-1] == _degrees(best.layout)[:-1]
    ]
    if not same:
        return text + "; no ep=1 layout of this shape fits"
    gap = min(c.step_time.total_s for c in same) - best.step_time.total_s
    return f"{text}; ep=1 is {gap:.3g} s slower"


def _degrees(lay: Layout) -> tuple[int, ...]:
    """What two layouts share to compare one choice between them: tp, pp, cp, world, ep."""
    d = lay.dims
    return d.tp, d.pp, d.cp, d.world_size, d.ep


def padding_reason(lay: Layout) -> str:
    """How an uneven layout cuts the global batch, e.g. "dp=3 reads 5/5/6 of 16; 2 padded slots"."""
    g, dp = lay.global_batch, lay.dims.dp
    shares = [stop - start for start, stop in (rank_slice(g, dp, r) for r in range(dp))]
    read = "/".join(map(str, shares)) if dp <= 8 else f"{min(shares)} or {max(shares)} each"
    return f"dp={dp} reads {read} of {g}; {lay.padded_slots} padded slots"


def alt_reason(c: Candidate, best: Candidate) -> str:
    delta = c.step_time.total_s - best.step_time.total_s
    if float(f"{delta:.6g}") <= 1e-9 * max(1.0, best.step_time.total_s):
        return (
            "ties with the best; tie-break prefers smaller tp, pp, zero, no AC, larger micro_batch"
        )
    diffs = {
        k: v - best.step_time.as_dict()[k]
        for k, v in c.step_time.as_dict().items()
        if k not in ("total_s", *HIDDEN_KEYS)
    }
    worst = max(diffs, key=lambda k: diffs[k])
    return (
        f"{delta:+.3g} s ({100 * delta / best.step_time.total_s:+.0f}%) vs best, "
        f"mostly {worst.removesuffix('_s')} ({diffs[worst]:+.3g} s)"
    )


def versus(free: Candidate, pinned: Candidate, budget_gb: float) -> str:
    """Why the planner's free pick differs from a pinned (e.g. a published) layout: the step
    times, the components that differ most, and the structural causes behind them."""
    a, b = free.layout, pinned.layout
    if _structure_of(a) == _structure_of(b):
        return "the free pick is the pinned layout"
    ft, pt = free.step_time.total_s, pinned.step_time.total_s
    parts = [
        f"free pick {a.describe()} at {ft:.3g} s/step is {abs(pt - ft):.3g} s "
        f"({100 * abs(pt - ft) / pt:.0f}%) {'faster' if ft <= pt else 'slower'} than the pinned "
        f"layout ({pt:.3g} s)"
    ]
    diffs = {
        k.removesuffix("_s"): pinned.step_time.as_dict()[k] - v
        for k, v in free.step_time.as_dict().items()
        if k not in ("total_s", *HIDDEN_KEYS)
    }
    big = sorted((k for k in diffs if abs(diffs[k]) >= 0.01 * pt), key=lambda k: -abs(diffs[k]))
    if big:
        parts.append("pinned minus free: " + ", ".join(f"{k} {diffs[k]:+.3g} s" for k in big[:3]))
    if a.dims.world_size != b.dims.world_size:
        parts.append(f"{a.dims.world_size} vs {b.dims.world_size} accelerators")
    if b.activation_checkpointing and not a.activation_checkpointing:
        parts.append("the pinned layout recomputes activations (1/3 more compute)")
    if a.dims.tp != b.dims.tp:
        parts.append(f"tp={a.dims.tp} vs {b.dims.tp}: GEMM width and TP traffic")
    if a.dims.pp != b.dims.pp or a.virtual_stages != b.virtual_stages:
        parts.append(
            f"pp={a.dims.pp} (v={a.virtual_stages}) vs {b.dims.pp} (v={b.virtual_stages}): bubble"
        )
    if a.dims.cp != b.dims.cp:
        parts.append(
            f"cp={a.dims.cp} vs {b.dims.cp}: activations per rank, ring traffic and the ranks "
            "left for data parallelism"
        )
    if a.dims.ep != b.dims.ep:
        parts.append(f"ep={a.dims.ep} vs {b.dims.ep}: expert weights gathered and all-to-alls")
    if a.zero_stage != b.zero_stage:
        parts.append(f"zero={a.zero_stage} vs {b.zero_stage}: data-parallel traffic and memory")
    elif a.dims.dp_replicate != b.dims.dp_replicate:
        parts.append(
            f"dp {a.dims.dp_replicate} x {a.dims.dp_shard} vs {b.dims.dp_replicate} x "
            f"{b.dims.dp_shard} (replicate x shard): where the sharded traffic runs"
        )
    if a.micro_batch != b.micro_batch:
        parts.append(f"micro_batch={a.micro_batch} vs {b.micro_batch}")
    if pinned.memory.total > budget_gb * GB:
        parts.append(
            f"the pinned layout needs {pinned.memory.total / GB:.1f} GB per accelerator, "
            f"over the {budget_gb:.0f} GB budget, so the planner cannot choose it: "
            + over_budget_term(pinned.memory, budget_gb)
        )
    return "; ".join(parts)


def over_budget_term(memory, budget_gb: float) -> str:
    """Which of activations and model states (parameters, gradients, optimizer state) breaks
    the budget, and by how much: the larger one against what the budget leaves it beside the
    other and the margin."""
    margin = memory.margin / memory.total
    terms = {
        "activations": memory.activations / GB,
        "model states": (memory.params + memory.grads + memory.optimizer) / GB,
    }
    big, small = sorted(terms, key=lambda k: -terms[k])
    room = budget_gb * (1.0 - margin) - terms[small]
    return (
        f"its {big} ({terms[big]:.1f} GB) are {terms[big] - room:.1f} GB over the {room:.1f} GB "
        f"the budget leaves them beside its {small} ({terms[small]:.1f} GB) and the "
        f"{margin:.0%} margin"
    )


def _structure_of(lay: Layout) -> tuple:
    return (
        lay.dims.shape,
        lay.dims.ep,
        lay.zero_stage,
        lay.micro_batch,
        lay.activation_checkpointing,
        lay.virtual_stages,
    )
