"""The GPU path's elasticity on the emulated accelerator (`cluster.device=emulated`): rank
actors on a device type of their own with an NCCL-like backend, across a rank death.

On NCCL a survivor blocked in a collective with the dead rank returns only when its communicator
is aborted; the emulated backend behaves the same way. So the actors' teardown must abort their
groups, and every survivor is then reused for the next layout (on gloo, a survivor blocked on a
dead peer waits out its timeout and is replaced instead).
"""

from __future__ import annotations

import pytest
import torch
from reference import global_batch_ids, load_checkpoint_params, reference_run

from raytrain_dt.control.coordinator import train
from raytrain_dt.data.source import TokenDataset
from raytrain_dt.observe.metrics import read_jsonl


@pytest.mark.timeout(600)
def test_rank_death_on_the_emulated_accelerator_reuses_every_survivor(restore_nodes, make_config):
    steps = 10
    cfg = make_config(
        "cluster.device=emulated", f"trainer.steps={steps}", "checkpoint.every_steps=3",
        "cluster.num_ranks=null", "chaos=[{at_step: 5, action: kill_rank, target: 1}]",
    )  # fmt: skip
    result = train(cfg, show_progress=False)
    assert result.final_step == steps

    events = read_jsonl(f"{result.run_dir}/events.jsonl")
    start = next(e for e in events if e["event"] == "start")
    resize = next(e for e in events if e["event"] == "resize")
    dead = start["pids"][1]
    assert len(start["pids"]) == 4
    # Every survivor is kept, none replaced: the new layout runs on the three old actors.
    assert sorted(resize["pids"]) == sorted(set(start["pids"]) - {dead}), (start, resize)

    metrics = read_jsonl(f"{result.run_dir}/metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    ref_losses, ref_params = reference_run(cfg, steps)
    assert [m["loss"] for m in metrics] == pytest.approx(ref_losses, abs=1e-5)
    params = load_checkpoint_params(result.latest_checkpoint)
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, atol=1e-5, rtol=0)
    dataset = TokenDataset.open(cfg.data.path, cfg.data.seq_len)
    for record in read_jsonl(f"{result.run_dir}/ledger.jsonl"):
        assert record["sample_ids"] == global_batch_ids(cfg, dataset, record["step"] - 1).tolist()
