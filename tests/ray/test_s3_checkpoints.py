"""Checkpoints on S3 (FSDP2's DCP files and DeepSpeed's staged ones) through the same code path
as real S3, against moto's server on localhost (`tests/s3_server.py`)."""

from __future__ import annotations

import pytest
from report_checks import check_manifest, file_reads_below
from s3_server import (  # noqa: F401
    BUCKET,
    S3_ENV,
    forget_s3_filesystems,
    remove_credentials,
    s3_endpoint,
)

from raytrain_dt.checkpoint.storage import Location
from raytrain_dt.checkpoint.store import CheckpointStore
from raytrain_dt.cli import main
from raytrain_dt.control.coordinator import train
from raytrain_dt.observe.metrics import read_jsonl

# The server for the whole module: fixtures imported from `s3_server` are this module's.
pytestmark = pytest.mark.usefixtures("ray_cluster", "s3_endpoint")


def test_s3_save_commit_skip_damaged_and_resume_exactly(make_config, tmp_path):
    root = f"s3://{BUCKET}/run/checkpoints"
    run_dir = tmp_path / "s3run"
    overrides = (
        "trainer.steps=8",
        "checkpoint.every_steps=4",
        "engine.zero_stage=3",
        f"checkpoint.dir={root}",
        f"cluster.forward_env=[{','.join(S3_ENV)}]",
    )
    with file_reads_below(root) as reads:
        train(make_config(*overrides, run_dir=run_dir), show_progress=False)
    # The driver committed from the ranks' digests: it read commit records, never a shard.
    assert {name.rsplit("/", 1)[-1] for name in reads} == {"commit.json"}
    uninterrupted = [m["loss"] for m in read_jsonl(run_dir / "metrics.jsonl")]
    assert len(uninterrupted) == 8
    committed = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "checkpoint"]
    assert [e["step"] for e in committed] == [4, 8]
    assert all(e["path"].startswith("s3://") and e["bytes"] > 0 for e in committed)

    # Everything is on S3, committed and intact (the digests the ranks took while uploading are
    # those of the stored objects); nothing went to the local run dir.
    forget_s3_filesystems()  # list what the server holds, not this process's listing cache
    store = CheckpointStore(root)
    assert [r.step for r in store.committed()] == [4, 8]
    for ref in store.committed():
        check_manifest(ref.uri)
    assert not (run_dir / "checkpoints").exists()

    # Truncate one shard of the newest checkpoint, as an interrupted upload would leave it.
    step_8 = Location.parse(store.step_uri(8))
    shard = sorted(n for n in step_8.files() if n.endswith(".distcp"))[0]
    with step_8.fs.open(step_8.child(shard).path, "rb") as f:
        head = f.read(100)
    with step_8.fs.open(step_8.child(shard).path, "wb") as f:
        f.write(head)
    forget_s3_filesystems()

    with file_reads_below(root) as reads:
        result = train(make_config(*overrides, "resume=true", run_dir=run_dir), show_progress=False)
    assert {name.rsplit("/", 1)[-1] for name in reads} == {"commit.json"}
    start = next(e for e in read_jsonl(run_dir / "events.jsonl")[::-1] if e["event"] == "start")
    assert start["resumed_from"].endswith("step_4")
    resumed = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in resumed] == list(range(1, 9))
    assert [m["loss"] for m in resumed[4:]] == pytest.approx(uninterrupted[4:], abs=1e-6)
    # The re-trained step 8 replaced the damaged one, committed and intact.
    assert result.latest_checkpoint.endswith("step_8")
    forget_s3_filesystems()
    ref = CheckpointStore(root).latest_valid()
    assert ref is not None and ref.step == 8
    assert ref.record["files"][shard]["size"] > 100
    check_manifest(ref.uri)


def test_deepspeed_s3_save_commit_resume_and_reshard(make_config, tmp_path):
    """DeepSpeed writes local files: each rank stages its own, uploads them, and the driver
    commits from their digests; a resume fetches each rank's files, a reshard converts from S3."""
    root = f"s3://{BUCKET}/deepspeed/checkpoints"
    run_dir = tmp_path / "ds-s3run"
    args = (
        "engine.name=deepspeed",
        "engine.zero_stage=2",
        "trainer.steps=6",
        "checkpoint.every_steps=3",
        f"checkpoint.dir={root}",
        f"cluster.forward_env=[{','.join(S3_ENV)}]",
    )
    with file_reads_below(root) as reads:
        train(make_config(*args, run_dir=run_dir), show_progress=False)
    assert {name.rsplit("/", 1)[-1] for name in reads} == {"commit.json"}
    uninterrupted = [m["loss"] for m in read_jsonl(run_dir / "metrics.jsonl")]
    assert len(uninterrupted) == 6
    events = read_jsonl(run_dir / "events.jsonl")
    assert not [e for e in events if e["event"] == "checkpoint_failed"]
    forget_s3_filesystems()
    store = CheckpointStore(root)
    assert [r.step for r in store.committed()] == [3, 6]
    for ref in store.committed():
        record = check_manifest(ref.uri)
        assert {
            "latest",
            "ds/mp_rank_00_model_states.pt",
            "ds/zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "ds/zero_pp_rank_1_mp_rank_00_optim_states.pt",
        } <= set(record["files"])
    assert not (run_dir / "checkpoints").exists()

    def lose_step_6() -> None:
        step_6 = Location.parse(store.step_uri(6))
        step_6.fs.rm(step_6.path, recursive=True)
        forget_s3_filesystems()

    # Same layout: each rank fetches the model states and its own optimizer partition.
    lose_step_6()
    result = train(make_config(*args, "resume=true", run_dir=run_dir), show_progress=False)
    assert result.final_step == 6
    start = next(e for e in read_jsonl(run_dir / "events.jsonl")[::-1] if e["event"] == "start")
    assert start["resumed_from"].endswith("step_3")
    resumed = [m["loss"] for m in read_jsonl(run_dir / "metrics.jsonl")]
    assert resumed[3:] == pytest.approx(uninterrupted[3:], abs=1e-6)
    forget_s3_filesystems()
    check_manifest(CheckpointStore(root).latest_valid().uri)

    # One rank: rank 0 converts the 2-rank checkpoint from a local copy and uploads the
    # universal form next to it on S3, where every rank fetches it.
    lose_step_6()
    one = make_config(*args, "resume=true", "cluster.num_ranks=1", run_dir=run_dir)
    result = train(one, show_progress=False)
    assert result.final_step == 6 and result.layout.dims.dp == 1
    resharded = [m["loss"] for m in read_jsonl(run_dir / "metrics.jsonl")]
    assert resharded[3:] == pytest.approx(uninterrupted[3:], abs=1e-5)
    forget_s3_filesystems()
    universal = Location.parse(store.step_uri(3)).child("ds_universal")
    assert any(name.startswith("zero/") for name in universal.files())


def test_deepspeed_pipeline_resumes_from_s3(make_config, tmp_path):
    """Two pipeline stages: each stage's ranks fetch their own stage's files (the stage check
    reads the model-states file through the staging directory too)."""
    root = f"s3://{BUCKET}/deepspeed-pp/checkpoints"
    run_dir = tmp_path / "ds-pp"
    args = (
        "engine.name=deepspeed",
        "parallel.pp=2",
        "trainer.grad_accum=2",
        "trainer.steps=4",
        "checkpoint.every_steps=2",
        f"checkpoint.dir={root}",
        f"cluster.forward_env=[{','.join(S3_ENV)}]",
    )
    train(make_config(*args, run_dir=run_dir), show_progress=False)
    uninterrupted = [m["loss"] for m in read_jsonl(run_dir / "metrics.jsonl")]
    forget_s3_filesystems()
    store = CheckpointStore(root)
    assert [r.step for r in store.committed()] == [2, 4]
    step_4 = Location.parse(store.step_uri(4))
    step_4.fs.rm(step_4.path, recursive=True)
    forget_s3_filesystems()
    result = train(make_config(*args, "resume=true", run_dir=run_dir), show_progress=False)
    assert result.final_step == 4 and result.layout.dims.pp == 2
    resumed = [m["loss"] for m in read_jsonl(run_dir / "metrics.jsonl")]
    assert resumed[2:] == pytest.approx(uninterrupted[2:], abs=1e-6)
    forget_s3_filesystems()
    check_manifest(CheckpointStore(root).latest_valid().uri)


def test_s3_checkpoint_dir_without_credentials_is_one_line(tmp_path, capsys, monkeypatch):
    remove_credentials(monkeypatch, tmp_path / "none")
    uri = f"s3://{BUCKET}/nocreds"
    args = ["train", "conf/test.yaml", f"run.dir={tmp_path / 'run'}", f"checkpoint.dir={uri}"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: checkpoint.dir: {uri}: ")
    assert "no AWS credentials" in err
