"""Experiment trackers on real runs: MLflow against a real tracking server on 127.0.0.1 that
the test session starts (tests/mlflow_server.py), and W&B in offline mode (no network), each
read back and compared with the run's own metrics.jsonl and events.jsonl."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from mlflow_server import MLFLOW_URI_FILE_ENV, start, wait_for_early_server, wait_healthy
from wandb_files import read_wandb_run

from raytrain_dt.control.coordinator import train
from raytrain_dt.observe.goodput import summarize
from raytrain_dt.observe.metrics import read_jsonl

pytestmark = pytest.mark.usefixtures("ray_cluster")


MLFLOW_START_S = 200


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """The URI of an `mlflow server` on 127.0.0.1 that answers /health: the one the xdist
    controller started early (tests/mlflow_server.py), else one of this module's own."""
    uri_file = os.environ.get(MLFLOW_URI_FILE_ENV)
    if uri_file:
        yield wait_for_early_server(Path(uri_file), MLFLOW_START_S)
        return
    server = start(tmp_path_factory.mktemp("mlflow"))
    try:
        # About 10 s on an idle 2-core host.
        wait_healthy(server.uri, MLFLOW_START_S, server.log_path, server.process)
        yield server.uri
    finally:
        server.stop()


def _history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]


@pytest.mark.timeout(MLFLOW_START_S + 240)  # the server's start is in the test's time
def test_mlflow_gets_params_steps_a_recovery_and_goodput(mlflow_server, make_config):
    """A rank killed at step 3 (the survivor restarts from step 2's checkpoint): the one
    MLflow run has the config as params, every step's loss (a step trained twice, where the
    failure lost one, keeps the later value), world size and tokens/s, the recovery with its
    cause, the run's goodput, and ends FINISHED."""
    from mlflow.tracking import MlflowClient

    cfg = make_config(
        "run.name=tracked",
        "trainer.steps=5",
        "checkpoint.every_steps=2",
        "chaos=[{at_step: 3, action: kill_rank, target: 1}]",
        f"metrics.mlflow.tracking_uri={mlflow_server}",
        "metrics.mlflow.experiment=trackers-test",
    )
    result = train(cfg, show_progress=False)
    metrics = read_jsonl(f"{result.run_dir}/metrics.jsonl")
    events = read_jsonl(f"{result.run_dir}/events.jsonl")
    recovery = next(e for e in events if e["event"] == "recovery")

    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("trackers-test")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "tracked"
    assert run.info.status == "FINISHED"
    assert run.data.params["trainer.steps"] == "5"
    assert run.data.params["metrics.mlflow.experiment"] == "trackers-test"
    assert json.loads(run.data.params["chaos"])[0]["action"] == "kill_rank"
    assert run.data.tags["raytrain_dt.run_dir"] == str(Path(result.run_dir).resolve())

    # Every step, in order; a step trained twice keeps the later value, as metrics.jsonl does.
    losses = _history(client, run.info.run_id, "loss")
    last = {}
    for step, value in losses:
        last[step] = value
    assert last == {m["step"]: pytest.approx(m["loss"], rel=1e-6) for m in metrics}
    assert len(metrics) <= len(losses) <= len(metrics) + recovery["lost_steps"]
    assert dict(_history(client, run.info.run_id, "world_size")) == {
        m["step"]: m["world_size"] for m in metrics
    }
    tokens = dict(_history(client, run.info.run_id, "tokens_per_s"))
    assert tokens[5] == pytest.approx(metrics[-1]["tokens_per_s"])
    assert {"lr", "grad_norm", "mfu", "step_time_s", "peak_mem_gib"} <= set(run.data.metrics)

    # The recovery at the step that ended it, and goodput as the report computes it.
    assert _history(client, run.info.run_id, "recovery/seconds") == [
        (recovery["step"], pytest.approx(recovery["recovery_s"]))
    ]
    assert _history(client, run.info.run_id, "recovery/lost_steps") == [
        (recovery["step"], recovery["lost_steps"])
    ]
    assert run.data.tags["recovery.1.cause"] == recovery["cause"] == "failed"
    summary = summarize(metrics, events)
    assert run.data.metrics["recoveries"] == 1
    assert run.data.metrics["goodput"] == pytest.approx(summary["goodput"], rel=1e-6)
    assert run.data.metrics["goodput/recovery_s"] == pytest.approx(summary["recovery_s"])
    # The run directory remembers the MLflow run, so that a resuming driver reopens it.
    kept = json.loads((Path(result.run_dir) / "trackers" / "mlflow.json").read_text())
    assert kept["run_id"] == run.info.run_id


@pytest.mark.timeout(240)
def test_wandb_offline_run_holds_the_config_every_step_and_the_summary(
    make_config, tmp_path, monkeypatch
):
    """W&B offline (and nowhere to reach): the run's file holds the config, one history row
    per step with metrics.jsonl's loss against `step`, the summary's last loss and goodput,
    and a clean exit."""
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_DISABLE_CODE": "true",
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb_cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb_data"),
        # Not W&B's servers, a closed local port: offline mode never asks.
        "WANDB_BASE_URL": "http://127.0.0.1:9",
    }.items():
        monkeypatch.setenv(name, value)
    cfg = make_config(
        "run.name=tracked-wandb",
        "trainer.steps=4",
        "metrics.wandb.enabled=true",
        "metrics.wandb.mode=offline",
        "metrics.wandb.project=trackers-test",
        f"metrics.wandb.dir={tmp_path / 'wandb_files'}",
    )
    result = train(cfg, show_progress=False)
    metrics = read_jsonl(f"{result.run_dir}/metrics.jsonl")
    events = read_jsonl(f"{result.run_dir}/events.jsonl")

    # `run.finish()` returns once W&B's service has the run's exit; the service then closes the
    # run's stream, and only then flushes the file's buffered block (a loaded host once read
    # it before: no record at all). `raytrain-dt train`'s process exit waits for that (W&B's
    # atexit teardown), and so does this.
    import wandb

    wandb.teardown()
    (run_file,) = (tmp_path / "wandb_files" / "wandb").glob("offline-run-*/run-*.wandb")
    run = read_wandb_run(run_file)
    assert run.name == "tracked-wandb" and run.project == "trackers-test"
    assert run.config["trainer"]["steps"] == 4
    assert run.config["metrics"]["wandb"]["mode"] == "offline"
    steps = [row for row in run.history if "loss" in row]
    assert [row["step"] for row in steps] == [m["step"] for m in metrics]
    assert [row["loss"] for row in steps] == pytest.approx([m["loss"] for m in metrics])
    assert [row["world_size"] for row in steps] == [m["world_size"] for m in metrics]
    assert all(row["tokens_per_s"] > 0 for row in steps)
    assert run.summary["loss"] == pytest.approx(metrics[-1]["loss"])
    assert run.summary["goodput"] == pytest.approx(summarize(metrics, events)["goodput"])
    assert run.exit_code == 0
    kept = json.loads((Path(result.run_dir) / "trackers" / "wandb.json").read_text())
    assert run_file.name == f"run-{kept['run_id']}.wandb"
