"""How a decoder's blocks split into pipeline stages: one split for the planner's cost and
memory models and for the pipeline code that cuts the model (`parallel/pipeline_parallel.py`).

Any number of stages up to the layer count: stage sizes are balanced by cost, the first stage
also carrying the embedding and the last the final norm and head (`end_cost` blocks' worth
each: the head's matmul against a block's), so with a large vocabulary the end stages get fewer
blocks, as Llama 3 405B's 16 stages do (7, 8 x 14, 7), and with a small one (Megatron's GPT)
the split is even. A split pinned by `parallel.pp_layers` replaces the balanced one. Pure
arithmetic.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

from raytrain_dt.models.presets import ModelShape
from raytrain_dt.topology.layout import Layout

# Default cost of the embedding (first stage) and of the final norm plus head (last stage), in
# blocks, for callers without a shape (`end_cost` gives a model's own).
END_COST = 1


def end_cost(shape: ModelShape) -> int:
    """Blocks' worth of an end stage's extra work: the head's vocab x dim matmul against a
    block's (llama-405b: 0.66 -> 1, llama-70b: 1.2 -> 1, Megatron's GPT-1T: 0.17 -> 0). The
    embedding is a lookup; both ends get the same so the split stays symmetric."""
    return round(shape.vocab_size * shape.dim / shape.params_per_layer)


def stage_layer_counts(
    n_layers: int, num_stages: int, end_cost: int = END_COST, pp: int = 0
) -> list[int]:
    """Blocks per stage, every stage at least one, with costs (blocks + end costs) as even as
    they can be: first per stage, then per pp rank.

    1. The largest stage cost is the smallest possible; each end stage keeps a block besides
       its extra work.
    2. `pp` ranks hold the stages looped (rank r: r, r + pp, ...; 0: one stage per rank) and a
       rank runs all of its stages every micro-batch, so under (1) the ranks' costs are
       levelled: the busiest rank is as cheap as any split makes it (llama-1b's 4-block head on
       4 ranks x 2 stages: 1, 3, 3, 1, 1, 3, 3, 1, every rank 6).
    3. Each rank's blocks are levelled over its own stages the same way.

    Where costs cannot all be equal (the cost is not a multiple of the parts), the dearer ones
    are the earliest ranks and, within a rank, its earliest stages: for one stage per rank the
    split torchtitan's `generate_llm_fqn_per_model_part` gives (32 blocks on 4 stages: 8, 9, 8,
    7; Llama 3 405B's 126 on 16: 7, 8 x 14, 7). So stage costs differ by at most a block where
    the end costs allow it, and chunk sizes by at most a block plus the end cost. Deterministic.
    (`pipeline_schedule.py` prices the activations each rank keeps in flight.)
    """
    if not 1 <= num_stages <= n_layers:
        raise ValueError(f"{num_stages} pipeline stages for {n_layers} layers")
    if num_stages == 1:
        return [n_layers]
    extra = [end_cost] + [0] * (num_stages - 2) + [end_cost]
    # (1) The smallest largest stage cost, and so the most blocks each stage may take.
    cap = max(1 + end_cost, -(-(n_layers + 2 * end_cost) // num_stages))
    most = [cap - e for e in extra]
    ranks = pp or num_stages
    held = [list(range(r, num_stages, ranks)) for r in range(ranks)]
    # (2) Blocks per rank, levelling the ranks' costs under that bound.
    per_rank = _level(
        n_layers,
        [len(stages) for stages in held],
        [sum(most[s] for s in stages) for stages in held],
        [sum(extra[s] for s in stages) for stages in held],
    )
    # (3) Each rank's blocks over its stages.
    counts = [0] * num_stages
    for stages, blocks in zip(held, per_rank, strict=True):
        own = _level(
            blocks, [1] * len(stages), [most[s] for s in stages], [extra[s] for s in stages]
        )
        for s, c in zip(stages, own, strict=True):
            counts[s] = c
    return counts


def _level(total: int, lows: list[int], highs: list[int], offsets: list[int]) -> list[int]:
    """`total` blocks in parts lows[i] <= a[i] <= highs[i] whose costs a[i] + offsets[i] are as
    even as they can be (water-filling): the largest cost is the smallest possible, and the
    parts at that cost beyond what `total` needs give a block back from the last one down."""
    if not sum(lows) <= total <= sum(highs):
        raise ValueError(f"{total} blocks cannot fill parts of {lows} to {highs} blocks")

    def fill(level: int) -> list[int]:
        return [min(hi, max(lo, level - o)) for lo, hi, o in zip(lows, highs, offsets)]

    low = min(lo + o for lo, o in zip(lows, offsets))
    high = max(hi + o for hi, o in zip(highs, offsets))
    while low < high:  # the lowest level whose fill holds `total`
        mid = (low + high) // 2
        if sum(fill(mid)) >= total:
            high = mid
        else:
            low = mid + 1
    parts = fill(low)
    surplus = sum(parts) - total
    for i in reversed(range(len(parts))):
        if surplus and parts[i] > lows[i] and parts[i] + offsets[i] == low:
            parts[i] -= 1
            surplus -= 1
    return parts


def pipeline_degrees(n_layers: int) -> list[int]:
    """Pipeline degrees the planner tries: the divisors of the layer count (even stages) and the
    powers of two up to it (uneven ones, as node counts usually are: Llama 3 405B's 126 layers
    on 16 stages). Not every degree: each one multiplies the search."""
    divisors = {p for p in range(1, n_layers + 1) if n_layers % p == 0}
    powers = {1 << k for k in range(n_layers.bit_length()) if 1 << k <= n_layers}
    return sorted(divisors | powers)


def stage_indices(pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """Stages held by one pp rank, looped: rank r holds r, r + pp, r + 2 pp, ..."""
    return [pp_rank + v * pp for v in range(virtual_stages)]


def split_of(shape: ModelShape, pp: int, virtual_stages: int = 1, pp_layers=()) -> list[int]:
    """Blocks per stage (pp x virtual_stages of them): the pinned split, else the balanced one."""
    return list(_split(shape, pp, virtual_stages, tuple(pp_layers)))


# The planner prices thousands of layouts on a few splits: each split is computed once.
@lru_cache(maxsize=4096)
def _split(shape: ModelShape, pp: int, virtual_stages: int, pp_layers: tuple) -> tuple[int, ...]:
    if pp_layers:
        return pp_layers
    return tuple(stage_layer_counts(shape.n_layers, pp * virtual_stages, end_cost(shape), pp))


def busiest_rank(
    shape: ModelShape, pp: int, virtual_stages: int = 1, pp_layers=()
) -> tuple[int, bool, bool]:
    """(blocks, holds the first stage, holds the last stage) of the pp rank with the most cost."""
    return _busiest(shape, pp, virtual_stages, tuple(pp_layers))


@lru_cache(maxsize=4096)
def _busiest(
    shape: ModelShape, pp: int, virtual_stages: int, pp_layers: tuple
) -> tuple[int, bool, bool]:
    counts = _split(shape, pp, virtual_stages, pp_layers)
    last, extra = len(counts) - 1, end_cost(shape)

    def rank(r: int) -> tuple[int, bool, bool]:
        stages = stage_indices(r, pp, virtual_stages)
        return sum(counts[s] for s in stages), 0 in stages, last in stages

    def cost(r: int) -> int:
        blocks, first, has_last = rank(r)
        return blocks + extra * (first + has_last)

    return rank(max(range(pp), key=cost))


def busiest_rank_share(shape: ModelShape, pp: int, virtual_stages: int = 1, pp_layers=()) -> float:
    """Share of the model's compute the busiest pp rank runs (1/pp for a perfect split); the
    embedding and the head count `end_cost` blocks each."""
    if pp == 1:
        return 1.0
    blocks, first, last = busiest_rank(shape, pp, virtual_stages, pp_layers)
    extra = end_cost(shape)
    return (blocks + extra * (first + last)) / (shape.n_layers + 2 * extra)


def heaviest_rank_params(
    shape: ModelShape, pp: int, virtual_stages: int = 1, pp_layers=()
) -> float:
    """Parameters of the pp rank that holds the most (before TP or ZeRO division): its blocks,
    plus the embedding on the first stage's rank and the final norm and head (a tied head is a
    second copy there) on the last's."""
    if pp == 1:
        return float(shape.num_params)
    return _heaviest_params(shape, pp, virtual_stages, tuple(pp_layers))


def heaviest_rank_blocks(shape: ModelShape, pp: int, virtual_stages: int = 1, pp_layers=()) -> int:
    """Blocks held by the pp rank of `heaviest_rank_params` (its routed experts are what expert
    parallelism splits)."""
    if pp == 1:
        return shape.n_layers
    return _heaviest(shape, pp, virtual_stages, tuple(pp_layers))[1]


def _heaviest_params(shape: ModelShape, pp: int, virtual_stages: int, pp_layers: tuple) -> float:
    return _heaviest(shape, pp, virtual_stages, pp_layers)[0]


@lru_cache(maxsize=4096)
def _heaviest(
    shape: ModelShape, pp: int, virtual_stages: int, pp_layers: tuple
) -> tuple[float, int]:
    """(parameters, blocks) of the pp rank with the most parameters."""
    counts = _split(shape, pp, virtual_stages, pp_layers)
    last = len(counts) - 1
    embedding = shape.vocab_size * shape.dim
    best = (0.0, 0)
    for r in range(pp):
        stages = stage_indices(r, pp, virtual_stages)
        blocks = sum(counts[s] for s in stages)
        params = blocks * shape.params_per_layer
        params += embedding if 0 in stages else 0
        params += embedding + shape.dim if last in stages else 0
        best = max(best, (float(params), blocks))
    return best


def too_few_microbatches(layout: Layout) -> str | None:
    """Why torch's 1F1B schedules refuse this layout, naming the key; None if they run it."""
    pp, m = layout.dims.pp, layout.grad_accum
    if pp > 1 and layout.pp_schedule != "gpipe" and m < pp:
        return (
            f"trainer.grad_accum: {m} micro-batches for parallel.pp={pp} stages; "
            f"parallel.pp_schedule={layout.pp_schedule} needs at least one per stage"
        )
    return None


def pp_layers_refusal(pp_layers, n_layers: int, pp: int | None, virtual_stages: int) -> str | None:
    """Why `parallel.pp_layers` cannot be used, as one line naming the key; None if it can."""
    if not pp_layers:
        return None
    if any(not isinstance(c, int) or c < 1 for c in pp_layers):
        return (
            f"parallel.pp_layers: every stage needs a positive int of layers, got {list(pp_layers)}"
        )
    if sum(pp_layers) != n_layers:
        return (
            f"parallel.pp_layers: {list(pp_layers)} sums to {sum(pp_layers)}, not "
            f"model.n_layers={n_layers}"
        )
    if pp is not None and len(pp_layers) != pp * virtual_stages:
        return (
            f"parallel.pp_layers: {len(pp_layers)} stages, but parallel.pp={pp} x "
            f"parallel.virtual_stages={virtual_stages} = {pp * virtual_stages}"
        )
    return None


# Virtual stages per rank the planner tries for the interleaved schedule when none is pinned:
# each halves the bubble again and costs more in-flight activations and point-to-point hops.
INTERLEAVE_DEGREES = (2, 4)


def schedule_variants(
    layout: Layout, n_layers: int, pinned_schedule: str | None, pinned_v: int | None
) -> list[Layout]:
    """`layout` and, where nothing pins the schedule, its interleaved 1F1B variants: v stages
    per rank while every stage keeps a layer and the micro-batches fill whole rounds of pp
    (what `pipeline_parallel.validate_pipeline` asks)."""
    pp, m = layout.dims.pp, layout.grad_accum
    if pp > 1 and layout.pp_schedule != "gpipe" and m < pp:
        return []  # torch's 1F1B schedules need a micro-batch per stage (`too_few_microbatches`)
    if pp == 1 or pinned_schedule or pinned_v or layout.pp_layers:
        return [layout]
    interleaved = [
        dataclasses.replace(layout, pp_schedule="interleaved", virtual_stages=v)
        for v in INTERLEAVE_DEGREES
        if pp * v <= n_layers and m % pp == 0
    ]
    return [layout, *interleaved]
