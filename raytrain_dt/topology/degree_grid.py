"""Which parallel degrees a cluster, a model and the pins allow: the cells the planner prices.

Each cell is (tp, pp, cp, dp, batch slots per rank, real global batch). TP divides the
accelerators per node and the head counts; PP is a pipeline degree of the layers; CP only where
a long sequence needs it (`cp_degrees`); DP at one world per per-rank share of the global batch
(O(sqrt(G)) degrees, not every one up to the cluster), with padding slots where dp does not
divide G (pp == 1 only) and, under a batch tolerance, the smaller exact batches it allows. Pure
arithmetic on the shape, the topology and the pins; the planner (`planner.py`) prices the cells.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from raytrain_dt.topology.memory import activation_bytes
from raytrain_dt.topology.pipeline_stages import pipeline_degrees


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def tp_pp(shape, topo, pins):
    """(tp, pp) pairs the node size, the model and the pins allow."""
    v = pins.virtual_stages or 1
    heads = (shape.n_heads, shape.n_kv_heads)
    tps = [t for t in divisors(topo.accelerators_per_node) if not any(h % t for h in heads)]
    pps = [p for p in pipeline_degrees(shape.n_layers) if p * v <= shape.n_layers]
    if pins.pp_layers:
        pins = dataclasses.replace(pins, pp=pins.pp or len(pins.pp_layers) // v)
    tps, pps = [pins.tp] if pins.tp else tps, [pins.pp] if pins.pp else pps
    return list(itertools.product(tps, pps))


# Context parallelism pays only for long sequences: below this, ring attention's per-hop kernel
# launches and softmax merges over short chunks cost more than the activations it saves, and
# published runs keep cp = 1 (Llama 3: cp = 1 at 8K tokens, cp = 16 at 131K).
CP_MIN_SEQ_LEN = 32768
# Nor is a rank given fewer tokens of a sequence than this (attention kernels go latency-bound).
CP_MIN_TOKENS_PER_RANK = 1024


def cp_degrees(shape, topo, pins, seq_len: int, precision: str) -> list[int]:
    """Context-parallel degrees worth planning: a pinned cp; else 1, and where a sequence of
    `seq_len` is long (CP_MIN_SEQ_LEN) and its activations alone (one sequence, no TP, no
    checkpointing) exceed an accelerator's memory, every power of two that splits it into
    2 x cp chunks of at least CP_MIN_TOKENS_PER_RANK / 2 tokens, up to the cluster."""
    if pins.cp:
        return [pins.cp]
    if seq_len < CP_MIN_SEQ_LEN or not cp_pays(shape, topo, seq_len, precision):
        return [1]
    out, cp = [1], 2
    while cp <= topo.num_accelerators and seq_len // cp >= CP_MIN_TOKENS_PER_RANK:
        if seq_len % (2 * cp) == 0:
            out.append(cp)
        cp *= 2
    return out


def cp_pays(shape, topo, seq_len: int, precision: str) -> bool:
    """Whether one sequence's activations (micro-batch 1, no TP, no checkpointing) exceed an
    accelerator's memory: what context parallelism is for."""
    one = activation_bytes(shape, seq_len=seq_len, micro_batch=1, precision=precision)
    return one > topo.memory_per_accelerator


def ep_degrees(shape, dp_shard: int, pins) -> list[int]:
    """Expert-parallel degrees for a dp_shard group: a pinned ep if it divides dp_shard; for
    an unpinned MoE shape every divisor of both the experts and dp_shard; else 1."""
    if pins.ep:
        return [pins.ep] if dp_shard % pins.ep == 0 else []
    if not shape.is_moe:
        return [1]
    return divisors(math.gcd(shape.n_experts, dp_shard))


def dp_step(pins) -> int:
    """The DP degrees a pinned dp_replicate, dp_shard or ep allow are multiples of this."""
    return (pins.dp_replicate or 1) * (pins.dp_shard or pins.ep or 1)


def dp_degrees(global_batch: int, most: int, pins) -> list[int]:
    """DP degrees worth planning, up to `most`: for each per-rank share ceil(G/dp) the smallest
    dp that reaches it (more ranks at the same share only add communication; an exact dp is
    always one), and `most` itself (more shards, less memory per rank). Multiples of a pinned
    dp_replicate or dp_shard only. O(sqrt(G)) of them, not every dp up to the cluster."""
    if pins.dp_replicate and pins.dp_shard:
        dp = pins.dp_replicate * pins.dp_shard
        return [dp] if dp <= most else []
    step = dp_step(pins)
    most -= most % step
    found = {most} if 0 < most <= global_batch else set()
    dp = step
    while dp <= min(most, global_batch):
        found.add(dp)
        share = -(-global_batch // dp)
        if share == 1:
            break
        fewer = -(-global_batch // (share - 1))  # the first dp with a smaller share
        dp = max(dp + step, -(-fewer // step) * step)
    return sorted(found)


def per_rank_slots(global_batch: int, dp: int, pp: int, pins) -> int | None:
    """Batch slots per DP rank and step (micro_batch x grad_accum), or None if no split of the
    global batch over `dp` honours the pins. G/dp when dp divides G, with the pins dividing it;
    otherwise the fewest slots >= ceil(G/dp) the pins allow, the rest being padding - only
    without pipeline stages (their schedules are exact-only) and with at most one of
    micro_batch and grad_accum pinned."""
    if global_batch % dp == 0:
        per_rank = global_batch // dp
        if any(x and per_rank % x for x in (pins.micro_batch, pins.grad_accum)):
            return None
        if pins.micro_batch and pins.grad_accum and pins.micro_batch * pins.grad_accum != per_rank:
            return None
        return per_rank
    if pp > 1 or (pins.micro_batch and pins.grad_accum) or dp > global_batch:
        return None
    unit = pins.micro_batch or pins.grad_accum or 1
    share = -(-global_batch // dp)
    return -(-share // unit) * unit


def smallest_batch(global_batch: int, tolerance: float) -> int:
    """The smallest real global batch `trainer.batch_tolerance` allows: ceil((1 - t) * G)."""
    return max(1, math.ceil(global_batch * (1.0 - tolerance) - 1e-9))


def degree_grid(shape, topo, pins, global_batch, least_batch=0, cps=(1,)):
    """(tp, pp, cp, dp, slots per rank, real batch) cells of every world up to the cluster that
    honour the pins: the exact global batch, and with a tolerance (`least_batch` < G) each
    smaller exact batch dp x share >= least_batch, at the largest dp for its share."""
    least_batch = least_batch or global_batch
    for (tp, pp), cp in itertools.product(tp_pp(shape, topo, pins), cps):
        most = topo.num_accelerators // (tp * pp * cp)
        if most < 1:
            continue
        dps = dp_degrees(global_batch, most, pins)
        for dp in dps:
            slots = per_rank_slots(global_batch, dp, pp, pins)
            if slots:
                yield tp, pp, cp, dp, slots, global_batch
        if least_batch >= global_batch:
            continue
        found = set()
        for dp in {*dps, *tolerated_dps(global_batch, least_batch, most, pins)}:
            for share in range(-(-least_batch // dp), -(-global_batch // dp) + 1):
                batch = share * dp
                if least_batch <= batch < global_batch and (dp, batch) not in found:
                    found.add((dp, batch))
                    if per_rank_slots(batch, dp, pp, pins) == share:
                        yield tp, pp, cp, dp, share, batch


def tolerated_dps(global_batch: int, least_batch: int, most: int, pins) -> set[int]:
    """For each per-rank share, the largest dp (up to `most`, a multiple of the pinned DP
    degree) whose exact batch dp x share is within the tolerance."""
    if pins.dp_replicate and pins.dp_shard:
        return set()
    step = dp_step(pins)
    out = set()
    for share in range(1, global_batch + 1):
        dp = min(most, global_batch // share)
        dp -= dp % step
        if dp >= 1 and dp * share >= least_batch:
            out.add(dp)
    return out


def dp_splits(dp, zero, model_ranks, topo, pins):
    """(dp_replicate, dp_shard) pairs: replicate for zero 0, shard for ZeRO, and for zero 3
    HSDP (shard inside a node, replicate across nodes) when the DP group spans nodes.
    `model_ranks`: the ranks of one DP index (tp x cp) that a node holds with each."""
    if pins.dp_replicate or pins.dp_shard:
        r = pins.dp_replicate or dp // pins.dp_shard
        s = dp // r
        return [] if (zero == 0 and s > 1) else [(r, s)]
    if zero == 0:
        return [(dp, 1)]
    splits = [(1, dp)]
    inner = topo.accelerators_per_node // model_ranks
    if zero == 3 and 1 < inner < dp and dp % inner == 0:
        splits.append((dp // inner, inner))
    return splits
