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


def _check_against_reference(cfg, result, steps: int) -> list[dict]:
    """Losses and final weights equal the single-process run; every sample exactly once."""
    metrics = read_jsonl(f"{result.run_dir}/metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    ref_losses, ref_params = reference_run(cfg, steps)
    assert [m["loss"] for m in metrics] == pytest.approx(ref_losses, abs=1e-4)
    params = load_checkpoint_params(result.latest_checkpoint)
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, atol=1e-4, rtol=0)
    dataset = TokenDataset.open(cfg.data.path, cfg.data.seq_len)
    ledger = read_jsonl(f"{result.run_dir}/ledger.jsonl")
    assert [r["step"] for r in ledger] == list(range(1, steps + 1))
    for record in ledger:
        assert record["sample_ids"] == global_batch_ids(cfg, dataset, record["step"] - 1).tolist()
    return metrics


def _resizes(result) -> list[dict]:
    return [e for e in read_jsonl(f"{result.run_dir}/events.jsonl") if e["event"] == "resize"]


def test_lost_node_shrinks_the_layout_and_training_continues_exactly(restore_nodes, make_config):
    cfg = make_config("trainer.steps=12", "checkpoint.every_steps=5", "cluster.num_ranks=null",
                      "engine.zero_stage=3", "chaos_step_delay_s=0.3",
                      "chaos=[{at_step: 8, action: kill_node, target: 3}]")  # fmt: skip
    result = train(cfg, simulated_cluster=restore_nodes, show_progress=False)
    metrics = _check_against_reference(cfg, result, 12)
    (resize,) = _resizes(result)
    assert resize["old_layout"]["dims"]["world_size"] == 4
    assert resize["new_layout"]["dims"]["world_size"] == 2
    failure = next(
        e for e in read_jsonl(f"{result.run_dir}/events.jsonl") if e["event"] == "failure"
    )
    assert resize["resumed_step"] == 5 and resize["lost_steps"] == failure["step"] - 5
    assert len(set(resize["node_ids"])) == 1
    assert [m["world_size"] for m in metrics] == [4] * 5 + [2] * 7  # steps 6-8 were re-trained
    assert result.layout.global_batch == cfg.trainer.global_batch


def test_preemption_notice_checkpoints_first_and_loses_no_step(restore_nodes, make_config):
    cfg = make_config("trainer.steps=10", "checkpoint.every_steps=10", "cluster.num_ranks=null",
                      "engine.zero_stage=3", "chaos_step_delay_s=0.3",
                      "chaos=[{at_step: 5, action: preempt_node, target: 3}]")  # fmt: skip
    result = train(cfg, simulated_cluster=restore_nodes, show_progress=False)
    _check_against_reference(cfg, result, 10)
    events = read_jsonl(f"{result.run_dir}/events.jsonl")
    notice = next(e for e in events if e["event"] == "preemption_notice")
    (resize,) = _resizes(result)
    # The only periodic checkpoint is the final one: the resize resumed from the checkpoint
    # taken just in time at the step boundary after the notice.
    assert resize["lost_steps"] == 0 and resize["resumed_step"] >= notice["step"]
    assert resize["new_layout"]["dims"]["world_size"] == 2
    assert not any(e["event"] == "failure" for e in events)


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
