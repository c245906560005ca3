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
    """Blocks per stage, every stage at least one: costs (blocks + end costs) as even as they
    can be, first per stage, then per pp rank; under those bounds the blocks themselves.

    1. The largest stage cost is the smallest possible; each end stage keeps a block besides
       its extra work, and gives up blocks only where that bound makes it.
    2. `pp` ranks hold the stages looped (rank r: r, r + pp, ...; 0: one stage per rank) and a
       rank runs all of its stages every micro-batch, so the busiest rank is next made as cheap
       as any split under (1) makes it.
    3. Under both bounds the blocks are spread as evenly as they go, first over the ranks, then
       over each rank's stages, so chunk sizes differ only where the embedding and the head
       force it (80 blocks on 5 ranks x 4 stages: 4 each). Where blocks cannot all be equal the
       earlier stages get the extra ones (torchtitan's `generate_llm_fqn_per_model_part` does
       the same for one stage per rank).

    Deterministic. (`pipeline_schedule.py` prices the activations each rank keeps in flight.)
    """
    if not 1 <= num_stages <= n_layers:
        raise ValueError(f"{num_stages} pipeline stages for {n_layers} layers")
    if num_stages == 1:
        return [n_layers]
    extra = [end_cost] + [0] * (num_stages - 2) + [end_cost]
    # (1) The smallest largest stage cost, and so the most blocks each stage may take.
    cap = max(1 + end_cost, -(-(n_layers + 2 * end_cost) // num_stages))
    stage_most = [cap - e for e in extra]
    ranks = pp or num_stages
    held = [list(range(r, num_stages, ranks)) for r in range(ranks)]
    fewest = [len(stages) for stages in held]
    most = [sum(stage_most[s] for s in stages) for stages in held]
    ends = [sum(extra[s] for s in stages) for stages in held]
    # (2) The smallest largest rank cost, and so the most blocks each rank may take.
    rank_cap = _lowest_level(n_layers, fewest, most, ends)
    rank_most = [min(hi, max(lo, rank_cap - e)) for lo, hi, e in zip(fewest, most, ends)]
    # (3) Blocks as even as they go under both bounds: over the ranks, then each rank's stages.
    counts = [0] * num_stages
    for stages, blocks in zip(held, _even(n_layers, fewest, rank_most), strict=True):
        own = _even(blocks, [1] * len(stages), [stage_most[s] for s in stages])
        for s, c in zip(stages, own, strict=True):
            counts[s] = c
    return counts


def _fill(level: int, lows: list[int], highs: list[int], offsets: list[int]) -> list[int]:
    """Each part raised to `level` (its offset included), within its bounds."""
    return [min(hi, max(lo, level - o)) for lo, hi, o in zip(lows, highs, offsets)]


def _lowest_level(total: int, lows: list[int], highs: list[int], offsets: list[int]) -> int:
    """The smallest level (water-filling) whose fill holds `total`: parts lows[i] <= a[i] <=
    highs[i] with every a[i] + offsets[i] at most that level, except parts whose low already
    exceeds it."""
    if not sum(lows) <= total <= sum(highs):
        raise ValueError(f"{total} blocks cannot fill parts of {lows} to {highs} blocks")
    low = min(lo + o for lo, o in zip(lows, offsets))
    high = max(hi + o for hi, o in zip(highs, offsets))
    while low < high:
        mid = (low + high) // 2
        if sum(_fill(mid, lows, highs, offsets)) >= total:
            high = mid
        else:
            low = mid + 1
    return low


def _even(total: int, lows: list[int], highs: list[int]) -> list[int]:
    """`total` in parts lows[i] <= a[i] <= highs[i] as even as they go: the largest part the
    smallest possible, the parts at that size beyond what `total` needs giving one back from
    the last down (so the earlier parts keep the extra ones)."""
    zeros = [0] * len(lows)
    level = _lowest_level(total, lows, highs, zeros)
    parts = _fill(level, lows, highs, zeros)
    surplus = sum(parts) - total
    for i in reversed(range(len(parts))):
        if surplus and parts[i] == level and parts[i] > lows[i]:
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


@lru_cache(maxsize=4096)
def _heaviest_params(shape: ModelShape, pp: int, virtual_stages: int, pp_layers: tuple) -> float:
    counts = _split(shape, pp, virtual_stages, pp_layers)
    last = len(counts) - 1
    embedding = shape.vocab_size * shape.dim
    best = 0.0
    for r in range(pp):
        stages = stage_indices(r, pp, virtual_stages)
        params = sum(counts[s] for s in stages) * shape.params_per_layer
        params += embedding if 0 in stages else 0
        params += embedding + shape.dim if last in stages else 0
        best = max(best, float(params))
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
