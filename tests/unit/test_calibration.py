"""The calibrated step-time model against published GPU runs: every row of
`published_runs.PUBLISHED_RUNS` within +-20% of its published throughput, and the planner's
free pick for each published job no slower than the published layout (or explained)."""

from __future__ import annotations

import pytest

from raytrain_dt.topology.calibration import (
    A100_80GB,
    H100_SXM,
    accelerator_for_peak,
    compute_efficiency,
)
from raytrain_dt.topology.cost import estimate_step_time
from raytrain_dt.topology.memory import MemoryEstimate
from raytrain_dt.topology.plan_reasons import over_budget_term, versus
from raytrain_dt.topology.published_runs import (
    FREE_PICK_SLACK,
    LLAMA3,
    MEGASCALE,
    MEGATRON,
    PUBLISHED_RUNS,
    SOURCES_CHECKED,
    TITAN_A100,
    TITAN_H100,
    TOLERANCE,
)


@pytest.mark.parametrize("row", PUBLISHED_RUNS, ids=lambda r: r.label)
def test_published_row_is_predicted_within_tolerance(row) -> None:
    assert abs(row.ratio() - 1.0) <= TOLERANCE, (
        f"{row.source} {row.label}: published {row.figure} {row.unit}, "
        f"predicted {row.predicted_figure():.1f} (ratio {row.ratio():.3f})"
    )


def test_every_source_the_issue_names_has_rows() -> None:
    sources = {r.source for r in PUBLISHED_RUNS}
    assert {MEGATRON, TITAN_A100, TITAN_H100, LLAMA3, MEGASCALE} <= sources
    assert sum(r.source == MEGATRON for r in PUBLISHED_RUNS) == 10  # the whole Table 1
    # MegaScale's Megatron-LM column: 4 GPU counts at batch 768 and 4 at batch 6144.
    assert sum(r.source == MEGASCALE for r in PUBLISHED_RUNS) == 8


def test_every_row_says_where_its_figure_was_read() -> None:
    # Each row names the URL (and table and row) its figure was read back from, and each
    # source says how it was checked.
    for row in PUBLISHED_RUNS:
        assert row.ref.startswith("https://"), row.label
    assert set(SOURCES_CHECKED) == {r.source for r in PUBLISHED_RUNS}
    assert all("https://" in where for where, _ in SOURCES_CHECKED.values())


def test_published_step_time_follows_the_sources_formula() -> None:
    # Megatron's 1T row: 502 PFLOP/s aggregate over 3072 GPUs (Table 1) is 163 per GPU.
    row = next(r for r in PUBLISHED_RUNS if r.label == "GPT 1008B")
    assert row.step_flops() / row.published_step_s() / 1e15 == pytest.approx(502, rel=0.01)
    # torchtitan: tokens per step / (tokens/s/GPU x GPUs).
    titan = next(r for r in PUBLISHED_RUNS if r.label == "Llama 3.1 8B, FSDP 8")
    assert titan.published_step_s() == pytest.approx(16 * 8192 / (5762 * 8))
    # MegaScale's MFU through our FLOP count (6 x params + attention) gives back Table 2's own
    # iteration times: the model shape, sequence 2048 and the MFU definition agree.
    iteration_s = [40.0, 21.2, 15.2, 11.9, 29.02, 14.78, 12.24, 8.57]
    megascale = [r for r in PUBLISHED_RUNS if r.source == MEGASCALE]
    for row, published in zip(megascale, iteration_s, strict=True):
        assert row.published_step_s() == pytest.approx(published, rel=0.006), row.label


def test_narrower_gemms_are_less_efficient() -> None:
    wide = compute_efficiency(16384, 1, H100_SXM.gemm_efficiency)
    narrow = compute_efficiency(16384, 8, H100_SXM.gemm_efficiency)
    assert H100_SXM.gemm_efficiency > wide > narrow > 0
    assert accelerator_for_peak(312e12) is A100_80GB
    assert accelerator_for_peak(989e12) is H100_SXM


def test_a_fixed_mfu_still_overrides_the_calibration() -> None:
    row = PUBLISHED_RUNS[0]
    kw = {"seq_len": row.seq_len}
    half = estimate_step_time(row.shape, row.layout(), row.topology(), mfu=0.5, **kw)
    quarter = estimate_step_time(row.shape, row.layout(), row.topology(), mfu=0.25, **kw)
    assert quarter.compute_s == pytest.approx(2 * half.compute_s)


# The published layouts our memory model refuses on their GPUs (FSDP2's fp32 gradients and
# 16 in-flight micro-batches of activations on the first of 16 stages): the free pick cannot be
# that layout, and `versus` says so.
OVER_BUDGET = {"Llama 3 405B, 8,192 GPUs, dp=64", "Llama 3 405B, 16,384 GPUs, dp=128"}


@pytest.mark.parametrize(
    "row", [r for r in PUBLISHED_RUNS if r.label not in OVER_BUDGET], ids=lambda r: r.label
)
def test_free_pick_is_no_slower_than_the_published_layout(row) -> None:
    ratio, why = row.free_vs_published()
    assert ratio <= 1 + FREE_PICK_SLACK, why
    if ratio < 1 - 1e-9:  # a different, faster layout: the reason names it and the gap
        assert why.startswith("free pick ") and "faster than the pinned layout" in why


@pytest.mark.parametrize(
    "row", [r for r in PUBLISHED_RUNS if r.label in OVER_BUDGET], ids=lambda r: r.label
)
def test_published_layout_over_the_memory_budget_is_explained(row) -> None:
    budget = row.topology().memory_per_accelerator
    assert row.published_candidate().memory.total > budget
    ratio, why = row.free_vs_published()
    assert ratio > 1 + FREE_PICK_SLACK
    assert "over the 80 GB budget, so the planner cannot choose it" in why
    # The interleaved schedule's in-flight activations, not the sharded states, break it.
    term = over_budget_term(row.published_candidate().memory, 80)
    assert term.startswith("its activations (") and term in why
    assert row.free_plan().best.memory.total <= budget


def test_versus_names_recomputation_tp_and_bubble() -> None:
    row = next(r for r in PUBLISHED_RUNS if r.label == "GPT 39.1B")
    free, published = row.free_plan().best, row.published_candidate()
    why = versus(free, published, 80)
    assert "the pinned layout recomputes activations" in why
    assert f"tp={free.layout.dims.tp} vs 8" in why and "vs 2 (v=1): bubble" in why
    assert versus(published, published, 80) == "the free pick is the pinned layout"


def test_over_budget_names_the_term_and_by_how_much() -> None:
    gb = 1e9
    mem = MemoryEstimate(6 * gb, 12 * gb, 2 * gb, 70 * gb, 10 * gb, 100 * gb)
    assert over_budget_term(mem, 80) == (
        "its activations (70.0 GB) are 18.0 GB over the 52.0 GB the budget leaves them beside "
        "its model states (20.0 GB) and the 10% margin"
    )
    states = MemoryEstimate(40 * gb, 40 * gb, 10 * gb, 0.0, 10 * gb, 100 * gb)
    assert over_budget_term(states, 80).startswith("its model states (90.0 GB) are 18.0 GB over")
