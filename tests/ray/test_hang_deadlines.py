"""Hang deadlines that follow the step, on the real cluster: steps slowed to three times the
`elastic.hang_timeout_s` floor are no hang (the planner's estimate bounds the first steps, the
p99 of the measured ones the rest), while a real hang is caught once it outlasts that bound.
"""

from __future__ import annotations

import pytest
from reference import reference_run

from raytrain_dt.control.coordinator import train
from raytrain_dt.control.run_setup import model_shape
from raytrain_dt.observe.metrics import read_jsonl
from raytrain_dt.topology.cost import compute_s
from raytrain_dt.topology.layout import Topology

FLOOR_S = 0.3
DELAY_S = 3 * FLOOR_S  # added to every step while the chaos is pending: 3x the floor
MULTIPLE = 5


def test_slow_steps_are_no_hang_and_a_real_hang_is_caught_within_its_bound(
    ray_cluster, make_config
):
    # A peak the planner's estimate of a step (its compute, at the default MFU) is the slowed
    # step with: the first steps are bounded by it, as a large model's are by its real one.
    cfg = make_config("trainer.steps=6", "checkpoint.every_steps=2")
    # Seconds at 1 FLOP/s of one rank's share of a step (2 data-parallel ranks).
    flop_s = compute_s(
        model_shape(cfg),
        cfg.trainer.global_batch // 2,
        1,
        Topology(1, 2, peak_flops=1.0),
        seq_len=cfg.data.seq_len,
        mfu=0.45,
    )
    peak_tflops = flop_s / DELAY_S / 1e12
    cfg = make_config(
        "trainer.steps=6",
        "checkpoint.every_steps=2",
        f"elastic.hang_timeout_s={FLOOR_S}",
        f"elastic.hang_step_multiple={MULTIPLE}",
        f"chaos_step_delay_s={DELAY_S}",
        f"cluster.peak_tflops={peak_tflops}",
        "chaos=[{at_step: 4, action: hang_rank, target: 1}]",
    )
    result = train(cfg, show_progress=False)
    assert result.final_step == 6
    events = read_jsonl(f"{result.run_dir}/events.jsonl")
    # The slowed steps 1-3 were not taken for a hang: the only failure is the real one.
    (failure,) = [e for e in events if e["event"] == "failure"]
    assert failure["health"] == "hung" and failure["step"] == 3
    # The bound in force was the p99 rule's: 5x the measured steps, which took the delay (3x
    # the floor) and more. The hang was declared once the group had gone that long without
    # progress (the driver polls every 0.1 s; a busy machine answers slower). Progress is a
    # step or a save written: step 2's save, written after step 3 on a loaded host, moved the
    # deadline on (CI: 4.6 s), so the time since the last step alone may be longer.
    assert failure["bound_basis"] == "p99" and f"{MULTIPLE} x p99 step" in failure["bound_detail"]
    assert failure["bound_s"] >= MULTIPLE * DELAY_S
    assert failure["bound_s"] < failure["since_progress_s"] <= failure["bound_s"] + 2.0
    assert failure["since_step_s"] >= failure["since_progress_s"]
    # The recovered run trained what an uninterrupted one does.
    metrics = read_jsonl(f"{result.run_dir}/metrics.jsonl")
    ref_losses, _ = reference_run(cfg, 6)
    assert [m["loss"] for m in metrics] == pytest.approx(ref_losses, abs=1e-5)
