"""Live pipeline activations per schedule: the replayed warm-up counts against the action lists
torch's own ScheduleInterleaved1F1B builds, 1F1B's pp - i per stage, and the Llama 3 405B split
priced on the rank that really peaks."""

from __future__ import annotations

import random

import pytest
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

from raytrain_dt.models.presets import PRESETS
from raytrain_dt.topology.memory import activation_bytes, korthikanti_layer_bytes
from raytrain_dt.topology.pipeline_schedule import live_peaks
from raytrain_dt.topology.pipeline_stages import split_of

L405 = PRESETS["llama-405b"]


def torch_interleaved_peaks(counts: tuple[int, ...], pp: int, m: int) -> set[tuple[int, int]]:
    """Replays the per-rank actions torch's interleaved schedule computes (built without
    stages or a process group: its order depends only on these four numbers)."""
    schedule = object.__new__(ScheduleInterleaved1F1B)
    schedule.pp_group_size, schedule.n_local_stages, schedule._n_microbatches = (
        pp,
        len(counts) // pp,
        m,
    )
    schedule.number_of_rounds = max(1, m // pp)
    schedule.microbatches_per_round = m // schedule.number_of_rounds
    last, most = len(counts) - 1, {}
    for rank in range(pp):
        blocks = tail = 0
        for action in schedule._calculate_single_rank_operations(rank):
            if action is None:
                continue
            forward = action.computation_type == _ComputationType.FORWARD
            assert forward or action.computation_type == _ComputationType.FULL_BACKWARD
            sign = 1 if forward else -1
            blocks += sign * counts[action.stage_index]
            tail += sign * (action.stage_index == last)
            if forward:
                most[tail] = max(blocks, most.get(tail, -1))
    return {
        (b, t) for t, b in most.items() if not any(t2 > t and b2 >= b for t2, b2 in most.items())
    }


@pytest.mark.parametrize(
    ("counts", "pp", "m"),
    [
        ((1, 2, 2, 2, 2, 2, 2, 1), 4, 4),
        ((1, 2, 2, 2, 2, 2, 2, 1), 4, 8),
        ((3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8), 4, 12),  # v = 3, three rounds of 4
        ((2,) * 16, 4, 6),  # m not a multiple of pp: one round of 6
        ((1,) + (2,) * 62 + (1,), 16, 32),  # Llama 3 405B at 8,192 GPUs
        ((1,) + (2,) * 62 + (1,), 16, 16),  # and at 16,384: one round, all forwards first
        ((5, 7, 6, 4, 3, 8), 2, 10),
    ],
)
def test_interleaved_peaks_equal_torchs_own_schedule(counts, pp, m) -> None:
    assert set(live_peaks(counts, pp, m, "interleaved")) == torch_interleaved_peaks(counts, pp, m)


def test_random_uneven_splits_equal_torchs_own_schedule() -> None:
    rng = random.Random(20)
    for _ in range(40):
        pp, v = rng.randint(2, 6), rng.randint(2, 4)
        m = pp * rng.randint(1, 3) + rng.choice((0, 0, 1))
        counts = tuple(rng.randint(1, 9) for _ in range(pp * v))
        assert set(live_peaks(counts, pp, m, "interleaved")) == torch_interleaved_peaks(
            counts, pp, m
        ), (counts, pp, m)


def test_interleaved_first_rank_holds_pp_v_plus_pp_minus_1_chunks() -> None:
    # Even split, one block per chunk: Narayanan et al.'s warm-up (v - 1) pp + 2 (pp - 1) plus
    # the first steady-state forward, on rank 0 (the last stage's rank holds (v - 1) pp + 1).
    pp, v = 8, 4
    peaks = dict(live_peaks((1,) * (pp * v), pp, 2 * pp, "interleaved"))
    assert max(peaks) == pp * v + pp - 1


def test_1f1b_stage_i_holds_pp_minus_i_micro_batches() -> None:
    # Llama 3 405B's 7, 8 x 14, 7 split: rank 1 (8 blocks x 15) outweighs rank 0 (7 x 16).
    counts = tuple(split_of(L405, 16))
    assert counts == (7,) + (8,) * 14 + (7,)
    assert set(live_peaks(counts, 16, 32, "1f1b")) == {(8 * 15, 0), (7, 1)}
    assert set(live_peaks(counts, 16, 32, "gpipe")) == {(8 * 32, 0), (7 * 32, 32)}
    assert set(live_peaks(counts, 16, 4, "1f1b")) == {(8 * 4, 0), (7, 1)}


def test_stages_beyond_pp_need_the_interleaved_schedule() -> None:
    with pytest.raises(ValueError, match="interleaved"):
        live_peaks((1,) * 8, 4, 8, "1f1b")


def test_llama3_405b_activations_are_the_peaking_ranks() -> None:
    layer = korthikanti_layer_bytes(8192, 1, L405.dim, L405.n_heads, tp=8, sequence_parallel=True)
    kw = {"seq_len": 8192, "micro_batch": 1, "tp": 8, "pp": 16, "sequence_parallel": True}
    one = activation_bytes(L405, grad_accum=32, **kw)
    assert one == 8 * 15 * layer
    four = activation_bytes(L405, grad_accum=32, virtual_stages=4, pp_schedule="interleaved", **kw)
    # Rank 1 (four 2-block chunks) warms up 3 * 16 + 2 * 14 chunk forwards and runs one more
    # before its first backward: 77 chunks of 2 blocks.
    assert four == 154 * layer
