"""Checkpoints on the shared Ray cluster: async saves commit only when complete and without the
driver reading them, a damaged newest checkpoint is found by the ranks and skipped on resume,
and a failing write fails the save, not the run."""

from __future__ import annotations

import pytest
from reference import reference_run
from report_checks import check_manifest, file_reads_below

from raytrain_dt.control.coordinator import train
from raytrain_dt.observe.metrics import read_jsonl

pytestmark = pytest.mark.usefixtures("ray_cluster")


def test_damaged_newest_checkpoint_falls_back_and_training_continues_exactly(
    make_config, tmp_path, caplog
):
    """The driver commits from the ranks' digests and reads no checkpoint byte, not at commit,
    not at resume; a shard changed in place (same size, so only its checksum tells) is found
    by the ranks before any of them loads it, and the run resumes from the previous one."""
    run_dir = tmp_path / "damaged"
    root = str(run_dir / "checkpoints")
    overrides = ("trainer.steps=8", "checkpoint.every_steps=4", "engine.zero_stage=3")
    with file_reads_below(root) as reads:
        train(make_config(*overrides, run_dir=run_dir), show_progress=False)
    # Commit records only (listing the checkpoints to prune), never a shard.
    assert {name.rsplit("/", 1)[-1] for name in reads} == {"commit.json"}
    uninterrupted = read_jsonl(run_dir / "metrics.jsonl")
    events = read_jsonl(run_dir / "events.jsonl")
    committed = [e for e in events if e["event"] == "checkpoint"]
    assert [e["step"] for e in committed] == [4, 8]
    assert all(e["stall_s"] < 5 and e["bytes"] > 0 for e in committed)
    check_manifest(f"{root}/step_8")

    shard = sorted((run_dir / "checkpoints" / "step_8").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit pattern in the middle: bit rot, same size
    shard.write_bytes(bytes(data))
    with file_reads_below(root) as reads:
        result = train(make_config(*overrides, "resume=true", run_dir=run_dir), show_progress=False)
    assert {name.rsplit("/", 1)[-1] for name in reads} == {"commit.json"}
    assert f"step_8/{shard.name}: checksum mismatch" in caplog.text
    events = read_jsonl(run_dir / "events.jsonl")
    (damaged,) = [e for e in events if e["event"] == "checkpoint_damaged"]
    assert damaged["step"] == 8 and damaged["problems"] == [
        f"{root}/step_8/{shard.name}: checksum mismatch"
    ]
    start = next(e for e in events[::-1] if e["event"] == "start")
    assert start["resumed_from"].endswith("step_4") and start["checkpoint_verify_s"] > 0
    resumed = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in resumed] == list(range(1, 9))
    assert [m["loss"] for m in resumed[4:]] == pytest.approx(
        [m["loss"] for m in uninterrupted[4:]], abs=1e-6
    )
    # The re-trained step 8 was saved and committed again, intact.
    assert result.latest_checkpoint.endswith("step_8")
    check_manifest(result.latest_checkpoint)


def test_failing_write_fails_the_save_not_the_run(make_config, tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the checkpoint directory should be")
    run_dir = tmp_path / "failing"
    cfg = make_config("checkpoint.every_steps=2", f"checkpoint.dir={blocker}/ckpt", run_dir=run_dir)
    result = train(cfg, show_progress=False)
    assert result.final_step == cfg.trainer.steps
    assert result.latest_checkpoint is None
    failures = [
        e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "checkpoint_failed"
    ]
    assert [e["step"] for e in failures] == [2, 4, 5]
    assert all(str(blocker) in e["error"] for e in failures)


def test_rank_killed_mid_save_never_commits_and_resume_continues_exactly(make_config):
    cfg = make_config(
        "trainer.steps=6",
        "checkpoint.every_steps=2",
        "engine.zero_stage=3",
        "chaos=[{at_step: 4, action: kill_rank_mid_save, target: 1}]",
    )
    result = train(cfg, show_progress=False)
    assert result.final_step == 6
    events = read_jsonl(f"{result.run_dir}/events.jsonl")
    timeline = [
        (e["event"], e.get("step", e.get("resumed_step")))
        for e in events
        if e["event"] in ("checkpoint", "failure", "resize")
    ]
    # Step 4's save lost a rank half-way: it was never committed, the run resumed from step 2
    # and committed step 4 only once re-trained.
    failure_at = next(i for i, (kind, _) in enumerate(timeline) if kind == "failure")
    assert timeline[:failure_at] == [("checkpoint", 2)]
    assert timeline[failure_at + 1 :] == [("resize", 2), ("checkpoint", 4), ("checkpoint", 6)]
    metrics = read_jsonl(f"{result.run_dir}/metrics.jsonl")
    ref_losses, _ = reference_run(cfg, 6)
    assert [m["loss"] for m in metrics] == pytest.approx(ref_losses, abs=1e-5)
