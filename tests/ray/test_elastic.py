"""Elastic training on the simulated multi-node cluster: failures, lost and added nodes,
preemption notices and hangs, checked against the single-process reference and the ledger.

These tests change the shared cluster's nodes and put it back as they found it.
"""

from __future__ import annotations

import pytest
import torch
from reference import global_batch_ids, load_checkpoint_params, reference_run

from raytrain_dt.control.cluster import SIMULATED_ACCELERATOR, alive_nodes
from raytrain_dt.control.coordinator import train
from raytrain_dt.data.source import TokenDataset
from raytrain_dt.observe.metrics import read_jsonl


@pytest.fixture
def restore_nodes(ray_cluster):
    """After the test, the cluster has the two accelerator nodes it started with."""
    yield ray_cluster
    while len(alive_nodes(SIMULATED_ACCELERATOR)) < 2:
        ray_cluster.add_node(num_cpus=1, resources={SIMULATED_ACCELERATOR: 2})
        ray_cluster.wait_for_nodes()


def test_failures_resizes_and_preemption_equal_an_uninterrupted_run(restore_nodes, make_config):
    cfg = make_config(
        "trainer.steps=30", "checkpoint.every_steps=5", "cluster.num_ranks=null",
        "engine.zero_stage=3", "elastic.grow_stable_s=1", "elastic.hang_timeout_s=60",
        "chaos_step_delay_s=0.4",
        "chaos=[{at_step: 6, action: kill_rank, target: 1}, {at_step: 12, action: kill_node, target: 3},"
        " {at_step: 18, action: add_node}, {at_step: 24, action: preempt_node, target: 3}]",
    )  # fmt: skip
    result = train(cfg, simulated_cluster=restore_nodes, show_progress=False)
    assert result.final_step == 30

    metrics = read_jsonl(f"{result.run_dir}/metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 31))
    ref_losses, ref_params = reference_run(cfg, 30)
    assert [m["loss"] for m in metrics] == pytest.approx(ref_losses, abs=1e-4)
    params = load_checkpoint_params(result.latest_checkpoint)
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, atol=1e-4, rtol=0)

    # Every sample of every step exactly once, in the order the global order defines.
    dataset = TokenDataset.open(cfg.data.path, cfg.data.seq_len)
    ledger = read_jsonl(f"{result.run_dir}/ledger.jsonl")
    assert [r["step"] for r in ledger] == list(range(1, 31))
    for record in ledger:
        assert record["sample_ids"] == global_batch_ids(cfg, dataset, record["step"] - 1).tolist()

    events = read_jsonl(f"{result.run_dir}/events.jsonl")
    resizes = [e for e in events if e["event"] == "resize"]
    worlds = [e["new_layout"]["dims"]["world_size"] for e in resizes]
    assert worlds == [4, 2, 4, 2], [e["reason"] for e in resizes]
    assert all(e["old_layout"] and e["new_layout"] for e in resizes)
    # The preemption was drained with a just-in-time checkpoint: no step lost.
    assert resizes[-1]["lost_steps"] == 0 and "preemption" in resizes[-1]["reason"]
    assert resizes[2]["lost_steps"] == 0  # growing waits for a checkpoint too
    assert {m["world_size"] for m in metrics} == {2, 4}


def test_hung_rank_is_detected_and_the_run_recovers(ray_cluster, make_config):
    cfg = make_config("trainer.steps=6", "checkpoint.every_steps=2", "elastic.hang_timeout_s=8",
                      "chaos=[{at_step: 4, action: hang_rank, target: 1}]")  # fmt: skip
    result = train(cfg, show_progress=False)
    assert result.final_step == 6
    events = read_jsonl(f"{result.run_dir}/events.jsonl")
    failure = next(e for e in events if e["event"] == "failure")
    assert failure["health"] == "hung"
    metrics = read_jsonl(f"{result.run_dir}/metrics.jsonl")
    ref_losses, _ = reference_run(cfg, 6)
    assert [m["loss"] for m in metrics] == pytest.approx(ref_losses, abs=1e-5)
