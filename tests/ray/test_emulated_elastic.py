"""The GPU path's elasticity on the emulated accelerator (`cluster.device=emulated`): rank
actors on a device type of their own with an NCCL-like backend, across a rank death.

On NCCL a survivor blocked in a collective with the dead rank returns only when its communicator
is aborted; the emulated backend behaves the same way. So the actors' teardown must abort their
groups, and every survivor is then reused for the next layout (on gloo, a survivor blocked on a
dead peer waits out its timeout and is replaced instead).
"""

from __future__ import annotations

import pytest
from reference import check_run_matches_reference

from raytrain_dt.control.coordinator import train
from raytrain_dt.observe.metrics import read_jsonl


@pytest.mark.timeout(600)
def test_rank_death_on_the_emulated_accelerator_reuses_every_survivor(restore_nodes, make_config):
    steps = 10
    cfg = make_config(
        "cluster.device=emulated",
        f"trainer.steps={steps}",
        "checkpoint.every_steps=3",
        "cluster.num_ranks=null",
        "chaos=[{at_step: 5, action: kill_rank, target: 1}]",
    )
    result = train(cfg, show_progress=False)
    assert result.final_step == steps

    events = read_jsonl(f"{result.run_dir}/events.jsonl")
    start = next(e for e in events if e["event"] == "start")
    resize = next(e for e in events if e["event"] == "resize")
    dead = start["pids"][1]
    assert len(start["pids"]) == 4
    # Every survivor is kept, none replaced: the new layout runs on the three old actors.
    assert sorted(resize["pids"]) == sorted(set(start["pids"]) - {dead}), (start, resize)

    # The emulated device computes with the CPU's kernels: the CPU's bound, not the elastic
    # tests' looser one.
    check_run_matches_reference(cfg, result, steps, atol=1e-5)
