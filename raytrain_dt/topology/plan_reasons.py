"""Why the planner chose what it chose: the one-line reasons of the best layout and of each
alternative, in the terms a practitioner checks (memory that forces sharding, what TP/PP buy
over data parallelism alone, how a padded layout cuts the global batch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from raytrain_dt.topology.layout import Layout, rank_slice
from raytrain_dt.topology.memory import GB, model_state_bytes, working_state_bytes

if TYPE_CHECKING:
    from raytrain_dt.topology.planner import Candidate


def states_gb(shape, dp, zero, precision, engine, tp=1, pp=1, grad_accum=1) -> float:
    """Model states per rank at their peak within a step, as `engine` holds them."""
    kw = {"tp": tp, "pp": pp, "shard": dp, "zero_stage": zero, "precision": precision}
    working = working_state_bytes(shape, **kw, engine=engine, grad_accum=grad_accum)
    return (sum(model_state_bytes(shape, **kw, engine=engine)) + sum(working)) / GB


def best_reason(
    best: Candidate, fitting: list[Candidate], shape, precision, engine, tie: float
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
            f"plain DP fits (model states {states_gb(shape, d.dp, 0, precision, engine, d.tp, d.pp):.1f} GB/rank)"
        )
    else:
        lower = [
            c
            for c in fitting
            if c.layout.zero_stage < z
            and (c.layout.dims.tp, c.layout.dims.pp, c.layout.dims.world_size)
            == (d.tp, d.pp, d.world_size)
        ]
        if lower:
            gap = min(c.step_time.total_s for c in lower) - best.step_time.total_s
            parts.append(f"zero={z} beats zero<{z} by {gap:.3g} s")
        else:
            need = states_gb(shape, d.dp_shard, z - 1, precision, engine, d.tp, d.pp)
            parts.append(
                f"model states {need:.1f} GB/rank at zero={z - 1} leave no room; zero>={z} needed"
            )
    if d.tp > 1 or d.pp > 1:
        pure = [
            c
            for c in fitting
            if c.layout.dims.tp == 1
            and c.layout.dims.pp == 1
            and c.layout.dims.world_size == d.world_size
        ]
        where = f"tp={d.tp} within a node, pp={d.pp}"
        if pure:
            gap = min(c.step_time.total_s for c in pure) - best.step_time.total_s
            parts.append(f"{where} is {gap:.3g} s faster than data parallelism alone")
        else:
            parts.append(f"{where}: no data-parallel-only layout fits")
    if lay.activation_checkpointing:
        parts.append("activation checkpointing trades 1/3 more compute for memory")
    if lay.padded_slots:
        parts.append(padding_reason(lay))
    return "; ".join(parts)


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
        if k not in ("total_s", "dp_hidden_s")
    }
    worst = max(diffs, key=lambda k: diffs[k])
    return (
        f"{delta:+.3g} s ({100 * delta / best.step_time.total_s:+.0f}%) vs best, "
        f"mostly {worst.removesuffix('_s')} ({diffs[worst]:+.3g} s)"
    )
