"""`trainer.batch_tolerance` on a real elastic run: a rank lost, the survivors train a smaller
real batch, and the run is still the single-process run on that same sequence of batches.

The test changes the shared cluster's nodes and puts it back as it found it.
"""

from __future__ import annotations

import pytest
from reference import check_run_matches_reference
from report_checks import check_report

from raytrain_dt.control.coordinator import train
from raytrain_dt.observe.metrics import read_jsonl


@pytest.mark.timeout(600)
def test_a_lost_rank_trains_on_at_a_smaller_real_batch(restore_nodes, make_config):
    """3 ranks (2 on one node, 1 on the other) of global batch 9, 3 samples each; the lone
    rank's node is preempted. The exact batch on the 2 survivors would be 5 slots each (one
    padded); a 12% tolerance trains 8 samples (4 each, exact) instead. Every step's loss is
    that of one process trained on the same real batches in order, and the ledger holds each
    step's samples exactly once: the data position advanced by the real batch."""
    steps = 10
    cfg = make_config(
        f"trainer.steps={steps}",
        "trainer.global_batch=9",
        "trainer.batch_tolerance=0.12",
        "checkpoint.every_steps=2",
        "cluster.num_ranks=3",
        "engine.zero_stage=3",
        "chaos_step_delay_s=0.3",
        "chaos=[{at_step: 4, action: preempt_node, target: 2}]",
    )
    result = train(cfg, simulated_cluster=restore_nodes, show_progress=False)
    metrics = read_jsonl(f"{result.run_dir}/metrics.jsonl")
    batches = [m["global_batch"] for m in metrics]
    # Each step's batch is the one its layout plans for its world size; both ran.
    assert {m["world_size"]: m["global_batch"] for m in metrics} == {3: 9, 2: 8}, metrics
    assert batches[:4] == [9] * 4 and batches[-1] == 8
    check_run_matches_reference(cfg, result, steps, atol=1e-4, batches=batches)
    events = read_jsonl(f"{result.run_dir}/events.jsonl")
    (shrink,) = [e for e in events if e["event"] == "resize"]
    layout = shrink["new_layout"]
    assert (layout["dims"]["world_size"], layout["micro_batch"] * layout["grad_accum"]) == (2, 4)
    assert layout["real_global_batch"] == 0 and shrink["lost_steps"] == 0  # exact; drained
    check_report(cfg, result.run_dir)
