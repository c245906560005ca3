"""FSDP2 training on the shared local Ray cluster, checked against the single-process reference."""

from __future__ import annotations

import shutil

import pytest
import torch
from reference import global_batch_ids, load_checkpoint_params, reference_run

from raytrain_dt.control.coordinator import train
from raytrain_dt.data.source import TokenDataset
from raytrain_dt.observe.metrics import read_jsonl

pytestmark = pytest.mark.usefixtures("ray_cluster")


def _assert_trains_like_one_process(cfg, result) -> list[dict]:
    """Losses and final weights equal the single-process reference's, and every step consumed
    exactly the global batch the documented order defines. Returns the metrics."""
    metrics = read_jsonl(f"{result.run_dir}/metrics.jsonl")
    ref_losses, ref_params = reference_run(cfg, cfg.trainer.steps)
    assert [m["step"] for m in metrics] == list(range(1, cfg.trainer.steps + 1))
    assert [m["loss"] for m in metrics] == pytest.approx(ref_losses, abs=1e-5)

    # The final checkpoint, gathered in one process, holds the reference's weights.
    params = load_checkpoint_params(result.latest_checkpoint)
    assert params.keys() == ref_params.keys()
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, atol=1e-5, rtol=0)

    dataset = TokenDataset.open(cfg.data.path, cfg.data.seq_len)
    ledger = read_jsonl(f"{result.run_dir}/ledger.jsonl")
    for record in ledger:
        assert record["sample_ids"] == global_batch_ids(cfg, dataset, record["step"] - 1).tolist()
    seen = [i for record in ledger for i in record["sample_ids"]]
    assert len(seen) == len(set(seen)) == cfg.trainer.steps * cfg.trainer.global_batch
    return metrics


@pytest.mark.parametrize("zero_stage", [0, 3], ids=["replicate", "fsdp-full"])
def test_two_rank_fsdp2_equals_single_process(make_config, zero_stage):
    cfg = make_config(
        "trainer.grad_accum=2", "checkpoint.every_steps=5", f"engine.zero_stage={zero_stage}"
    )
    result = train(cfg, show_progress=False)
    assert result.layout.dims.dp == 2 and result.layout.grad_accum == 2
    assert result.layout.zero_stage == zero_stage
    metrics = _assert_trains_like_one_process(cfg, result)
    assert all(m["world_size"] == 2 for m in metrics)


def test_three_ranks_split_an_uneven_batch_like_one_process(make_config):
    """3 ranks of global batch 16: the planner keeps all 3 (5/5/6 samples in 6 slots each, 2
    padded) rather than idle one for dp=2, and the run is still the single-process one: same
    losses and weights, and the ledger (real rows only) holds each step's batch exactly once."""
    cfg = make_config(
        "trainer.global_batch=16",
        "trainer.grad_accum=2",
        "cluster.num_ranks=3",
        "checkpoint.every_steps=5",
        "engine.zero_stage=3",
    )
    result = train(cfg, show_progress=False)
    layout = result.layout
    assert (layout.dims.dp, layout.global_batch, layout.padded_slots) == (3, 16, 2)
    _assert_trains_like_one_process(cfg, result)


def test_resume_equals_uninterrupted(make_config, tmp_path):
    run_dir = tmp_path / "resume"
    cfg = make_config("trainer.steps=8", "checkpoint.every_steps=4", run_dir=run_dir)
    train(cfg, show_progress=False)
    uninterrupted = read_jsonl(run_dir / "metrics.jsonl")

    # Lose everything after step 4, as a crash between the two saves would.
    shutil.rmtree(run_dir / "checkpoints" / "step_8")
    resumed_cfg = make_config(
        "trainer.steps=8", "checkpoint.every_steps=4", "resume=true", run_dir=run_dir
    )
    result = train(resumed_cfg, show_progress=False)
    resumed = read_jsonl(run_dir / "metrics.jsonl")
    assert result.final_step == 8
    assert [m["step"] for m in resumed] == list(range(1, 9))
    assert [m["loss"] for m in resumed[4:]] == pytest.approx(
        [m["loss"] for m in uninterrupted[4:]], abs=1e-6
    )
    ledger = read_jsonl(run_dir / "ledger.jsonl")
    assert [r["step"] for r in ledger] == list(range(1, 9))
    seen = [i for r in ledger for i in r["sample_ids"]]
    assert len(seen) == len(set(seen))


def test_existing_checkpoints_are_not_overwritten(make_config, tmp_path):
    from raytrain_dt.errors import UserError

    run_dir = tmp_path / "guarded"
    step_dir = run_dir / "checkpoints" / "step_3"
    step_dir.mkdir(parents=True)
    (step_dir / "commit.json").write_text('{"step": 3, "train_state": {}, "files": {}}')
    with pytest.raises(UserError, match="resume=true"):  # resume=false: never start over it
        train(make_config("resume=false", run_dir=run_dir), show_progress=False)
    assert (step_dir / "commit.json").exists()
