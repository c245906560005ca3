"""How many micro-batches of each pipeline stage's activations a schedule keeps alive at once.

Replays, on block counts, the order of forwards and backwards that torch.distributed.pipelining's
schedules (the ones `parallel/pipeline_parallel.py` runs) give each pp rank, and reports the
states at which a rank's live activations can peak. A stage's forward stores its activations
until the backward of the same micro-batch frees them, so a rank's live set is the forwards it
has run minus the backwards. The counts follow the schedules' own warm-up rules:

- GPipe runs every forward before any backward: m micro-batches per stage.
- 1F1B (`Schedule1F1B`; Narayanan et al. 2021, §2.2.1): rank r warms up min(m, pp - r)
  forwards, then alternates one backward and one forward, so stage i holds pp - i.
- Interleaved 1F1B (`ScheduleInterleaved1F1B._get_warmup_ops`, Megatron-LM's
  `forward_backward_pipelining_with_interleaving`; Narayanan et al. 2021, §2.2.2): rank r warms
  up (v - 1) * n + 2 * (pp - 1 - r) chunk forwards (n micro-batches per round, pp when m is a
  multiple of pp), then runs one forward and one backward per step. Rank 0 so holds
  pp * v + pp - 1 chunks of 1/v of its blocks: pp * (1 + (pp - 1) / (pp * v)) micro-batches'
  worth, the factor Korthikanti et al. 2022 (§4.2.3) give for the interleaved schedule. The
  warm-up is capped at all m * v chunk forwards: with m == pp (one round) every forward runs
  before the first backward, as both torch and Megatron-LM (`all_warmup_microbatches`) do.

With uneven stages the rank with the most in flight need not hold the most blocks (Llama 3
405B's 7, 8 x 14, 7 split: rank 1 holds 8 x 15 blocks under 1F1B, rank 0 7 x 16), so every
rank is replayed. Pure arithmetic.
"""

from __future__ import annotations

from functools import lru_cache

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def live_peaks(
    counts: tuple[int, ...], pp: int, microbatches: int, schedule: str
) -> tuple[tuple[int, int], ...]:
    """States at which some rank's live activations can peak, as (blocks' activations alive,
    micro-batches alive on the last stage, whose logits the loss keeps for backward): the
    pairs no other state exceeds in both. `counts` is blocks per stage, pp * v of them."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pp_schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if len(counts) != pp and schedule != "interleaved":
        raise ValueError(f"{len(counts)} stages on {pp} ranks need the interleaved schedule")
    return _live_peaks(tuple(counts), pp, microbatches, schedule)


@lru_cache(maxsize=4096)
def _live_peaks(
    counts: tuple[int, ...], pp: int, microbatches: int, schedule: str
) -> tuple[tuple[int, int], ...]:
    # Most blocks alive at any forward, per count of last-stage micro-batches alive.
    most: dict[int, int] = {}
    for rank in range(pp):
        for blocks, tail in _rank_states(counts, rank, pp, microbatches, schedule):
            if blocks > most.get(tail, -1):
                most[tail] = blocks
    return tuple(
        (b, t) for t, b in most.items() if not any(t2 > t and b2 >= b for t2, b2 in most.items())
    )


def _rank_states(counts: tuple[int, ...], rank: int, pp: int, m: int, schedule: str):
    """(blocks alive, last-stage micro-batches alive) just after each forward of `rank` at
    which either can peak."""
    last = len(counts) - 1
    if schedule != "interleaved":
        # GPipe and 1F1B hold one stage per rank; 1F1B's steady state frees one micro-batch
        # before it stores the next, so the warm-up is its peak.
        warmup = m if schedule == "gpipe" else min(m, pp - rank)
        yield warmup * counts[rank], warmup * (rank == last)
        return
    v = len(counts) // pp
    rounds = max(1, m // pp)
    per_round = m // rounds
    total = m * v  # chunk forwards (and backwards) this rank runs per step
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), total)

    def runs_on(local: int, ops: int) -> int:
        """How many of the first `ops` forwards run chunk `local`: forward i runs chunk
        (i // per_round) % v, and backward i chunk v - 1 - (i // per_round) % v."""
        cycles, rest = divmod(ops, per_round * v)
        return cycles * per_round + min(max(rest - local * per_round, 0), per_round)

    def state(forwards: int, backwards: int) -> tuple[int, int]:
        alive = [runs_on(c, forwards) - runs_on(v - 1 - c, backwards) for c in range(v)]
        blocks = sum(counts[c * pp + rank] * n for c, n in enumerate(alive))
        return blocks, alive[-1] * (rank == last % pp)

    if warmup == total:  # every forward before the first backward
        yield state(total, 0)
        return
    # Steady state, step s: a forward (the (s + 1)-th) then a backward (the (s - warmup + 1)-th).
    # Within a run of one forward chunk and one backward chunk the live set changes linearly,
    # so it peaks where a run starts or ends; the runs repeat every v rounds.
    end = min(total, warmup + per_round * v + 1)
    edges = {warmup, end - 1}
    for start in range(0, end + per_round, per_round):
        for base in (start, start + warmup):
            edges.update(s for s in (base - 1, base) if warmup <= s < end)
    for s in sorted(edges):
        yield state(s + 1, s - warmup)
