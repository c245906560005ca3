"""Context and expert parallelism through the real run path (planner pins, Ray actors, Ray Data,
DCP checkpoints, elastic re-plans), checked against the single-process reference and the
ledger: cp ranks read the same samples, ep moves tokens not samples, and a shrink that leaves
too few ranks for the pinned ep re-plans a smaller one and continues exactly."""

from __future__ import annotations

import pytest
from reference import check_run_matches_reference

from raytrain_dt.control.coordinator import train
from raytrain_dt.observe.metrics import read_jsonl


def test_context_parallel_run_trains_like_one_process(ray_cluster, make_config):
    """cp=2 on two ranks: one data-parallel rank whose sequences are split in two, so every
    step's batch is read once (the ledger) and the losses and weights are the reference's."""
    steps = 4
    cfg = make_config(f"trainer.steps={steps}", "checkpoint.every_steps=4", "parallel.cp=2")
    result = train(cfg, show_progress=False)
    dims = result.layout.dims
    assert (dims.world_size, dims.cp, dims.dp) == (2, 2, 1)
    check_run_matches_reference(cfg, result, steps, atol=1e-5)


def test_expert_parallel_run_trains_like_one_process_and_logs_the_router(ray_cluster, make_config):
    """moe-tiny with ep=2 and a capacity that drops tokens: the run equals the reference, and
    each step's router statistics account for every routed token of the global batch."""
    steps = 4
    cfg = make_config(
        f"trainer.steps={steps}",
        "checkpoint.every_steps=4",
        "model.preset=moe-tiny",
        "model.capacity_factor=1.0",
        "parallel.ep=2",
    )
    result = train(cfg, show_progress=False)
    dims = result.layout.dims
    assert (dims.world_size, dims.dp_shard, dims.ep) == (2, 2, 2)
    metrics = check_run_matches_reference(cfg, result, steps, atol=1e-5)
    shape = cfg.model
    routed = cfg.trainer.global_batch * cfg.data.seq_len * 2 * 4  # top-2, 4 MoE blocks
    for row in metrics:
        router = row["router"]
        assert len(router["tokens_per_expert"]) == 4, shape
        assert sum(router["tokens_per_expert"]) + router["dropped"] == routed
        assert 0 < router["drop_rate"] == pytest.approx(router["dropped"] / routed)


# Two formations of four then two ranks; a minute alone on this machine, more when shared.
@pytest.mark.timeout(600)
def test_a_shrink_below_the_pinned_ep_re_plans_it_and_continues_exactly(restore_nodes, make_config):
    """ep=4 on four ranks (one expert each); the node of ranks 2 and 3 is lost, so ep=4 has no
    ranks left to split over: the pin is an upper bound, the run re-forms at ep=2 on the two
    survivors, reshards the experts from the checkpoint, and trains what one process would."""
    steps = 10
    cfg = make_config(
        f"trainer.steps={steps}",
        "checkpoint.every_steps=5",
        "cluster.num_ranks=null",
        "model.preset=moe-tiny",
        "model.capacity_factor=1.0",
        "parallel.ep=4",
        "chaos_step_delay_s=0.3",
        "chaos=[{at_step: 7, action: kill_node, target: 3}]",
    )
    result = train(cfg, simulated_cluster=restore_nodes, show_progress=False)
    assert result.final_step == steps
    check_run_matches_reference(cfg, result, steps, atol=1e-5)
    resizes = [e for e in read_jsonl(f"{result.run_dir}/events.jsonl") if e["event"] == "resize"]
    # Both survivors kept: one replaced as stuck would re-form on the other alone, at ep=1.
    assert [(r["old_layout"]["dims"]["ep"], r["new_layout"]["dims"]["ep"]) for r in resizes] == [
        (4, 2)
    ], [(r["new_layout"]["dims"], r["kept_actors"], r["new_actors"]) for r in resizes]
    assert resizes[0]["new_layout"]["dims"]["world_size"] == 2
