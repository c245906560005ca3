"""A failure without notice resumes from the ranks' in-memory copies (`worker/peer_copies.py`),
not from the last durable checkpoint: at most one step is lost, and the run still trains
exactly what an uninterrupted one does (losses, final weights, every step's samples).

Copies are taken every step (`checkpoint.memory_every_steps=1`). The durable checkpoint is
written only at the end (`every_steps` beyond the run), so any
resume from storage would restart at step 0 and show as lost steps. These tests change the
shared cluster's nodes and put them back as they found them.
"""

from __future__ import annotations

import pytest
from reference import check_run_matches_reference

from raytrain_dt.control.coordinator import train
from raytrain_dt.observe.metrics import read_jsonl

STEPS = 10


def _config(make_config, chaos: str):
    return make_config(
        f"trainer.steps={STEPS}",
        "checkpoint.every_steps=100",
        "checkpoint.memory_every_steps=1",
        "cluster.num_ranks=null",
        "engine.zero_stage=3",
        # A step longer than a copy (as on real hardware, where a step takes seconds): on this
        # shared 2-core host a bare tiny step is far shorter than serialising and sending its
        # copy (seconds under load: `memory_copy_s` of the resize event).
        "chaos_step_delay_s=2.0",
        f"chaos=[{chaos}]",
    )


def _events(result) -> tuple[dict, dict, list[dict]]:
    events = read_jsonl(f"{result.run_dir}/events.jsonl")
    (failure,) = [e for e in events if e["event"] == "failure"]
    resizes = [e for e in events if e["event"] == "resize"]
    return failure, resizes[0], events


@pytest.mark.timeout(900)
def test_a_rank_death_resumes_from_memory_copies(ray_cluster, make_config):
    cfg = _config(make_config, "{at_step: 8, action: kill_rank, target: 1}")
    result = train(cfg, show_progress=False)
    assert result.final_step == STEPS
    check_run_matches_reference(cfg, result, STEPS, atol=1e-5)
    failure, resize, _ = _events(result)
    assert failure["health"] == "failed" and failure["step"] == 7
    # Rank 1's own copy died with it; its peer's copy on the other node stands in.
    assert resize["resumed_from"].startswith("memory://")
    assert resize["lost_steps"] <= 1, resize
    assert resize["resumed_step"] == failure["step"] - resize["lost_steps"]


@pytest.mark.timeout(900)
def test_a_node_loss_resumes_from_the_peers_copies(restore_nodes, make_config):
    """Ranks 2 and 3 die with their node; their copies on the other node's actors survive."""
    cfg = _config(make_config, "{at_step: 6, action: kill_node, target: 3}")
    result = train(cfg, simulated_cluster=restore_nodes, show_progress=False)
    assert result.final_step == STEPS
    check_run_matches_reference(cfg, result, STEPS, atol=1e-5)
    failure, resize, _ = _events(result)
    assert failure["step"] >= 6
    assert resize["old_layout"]["dims"]["world_size"] == 4
    assert resize["new_layout"]["dims"]["world_size"] == 2
    assert resize["resumed_from"].startswith("memory://")
    assert resize["lost_steps"] <= 1
    assert resize["resumed_step"] == failure["step"] - resize["lost_steps"]


@pytest.mark.timeout(900)
def test_a_preemption_keeps_the_state_in_memory(restore_nodes, make_config):
    """Issue 19 item 4: on a notice the group drains into its in-memory copies (ranks 2 and 3
    leave; their copies are held on the other node) and re-forms from them: no step lost,
    nothing saved to or loaded from storage before the run's final checkpoint."""
    cfg = _config(make_config, "{at_step: 6, action: preempt_node, target: 3}")
    result = train(cfg, simulated_cluster=restore_nodes, show_progress=False)
    assert result.final_step == STEPS
    check_run_matches_reference(cfg, result, STEPS, atol=1e-5)
    events = read_jsonl(f"{result.run_dir}/events.jsonl")
    (drained,) = [e for e in events if e["event"] == "drained"]
    (resize,) = [e for e in events if e["event"] == "resize"]
    assert drained["in_memory"] is True and drained["step"] >= 6
    assert resize["new_layout"]["dims"]["world_size"] == 2
    assert resize["resumed_from"] == f"memory://g1/step_{drained['step']}"
    assert resize["resumed_step"] == drained["step"] and resize["lost_steps"] == 0
    assert [e["step"] for e in events if e["event"] == "checkpoint"] == [STEPS]
