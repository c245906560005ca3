"""Experiment tracker sinks without Ray: a recorded real run (a rank killed at step 3, the
group restarting from step 2's checkpoint) replayed into MLflow (a local SQLite store) and W&B
(offline); a driver restart going on in the same tracker runs; an unreachable server; and bad
tracker options, refused with one line naming the key and exit code 2."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from wandb_files import read_wandb_run

from raytrain_dt.cli import main
from raytrain_dt.config import load_config
from raytrain_dt.observe.goodput import summarize
from raytrain_dt.observe.metrics import read_jsonl
from raytrain_dt.observe.trackers import MlflowSink, flat_params, tracker_sinks

REPO = Path(__file__).resolve().parents[2]
# `raytrain-dt train conf/test.yaml trainer.steps=5 checkpoint.every_steps=2
# chaos=[{at_step: 3, action: kill_rank, target: 1}]`: its metrics.jsonl and events.jsonl.
RECORDED = REPO / "tests" / "data" / "trackers" / "kill_rank_run"
METRICS, EVENTS = read_jsonl(RECORDED / "metrics.jsonl"), read_jsonl(RECORDED / "events.jsonl")
RECOVERY = next(e for e in EVENTS if e["event"] == "recovery")
FAILURE = next(e for e in EVENTS if e["event"] == "failure")
NO_DATA = "data.path=/nonexistent/raytrain_dt_tokens"


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb_cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb_data"),
    }.items():
        monkeypatch.setenv(name, value)
    return tmp_path / "wandb_files"


def _config(tmp_path: Path, *overrides: str):
    return load_config(REPO / "conf" / "test.yaml", [f"run.dir={tmp_path / 'run'}", *overrides])


def _replay(sinks, run_dir: Path, after: float = 0.0, until: float = float("inf")) -> None:
    """The recorded records with `after < time <= until`, in the order the driver wrote them:
    each appended to the run directory's file, then handed to the sinks (as RunRecorder)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    records = [("metrics", m) for m in METRICS] + [("events", e) for e in EVENTS]
    for name, record in sorted(records, key=lambda r: r[1]["time"]):
        if not after < record["time"] <= until:
            continue
        with open(run_dir / f"{name}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        for sink in sinks:
            (sink.on_step if name == "metrics" else sink.on_event)(record)


def _mlflow_run(uri: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("raytrain_dt").experiment_id])
    return client, run


def test_a_recorded_recovery_reaches_mlflow_and_wandb(tmp_path, offline_wandb):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = _config(
        tmp_path,
        f"metrics.mlflow.tracking_uri={uri}",
        "metrics.wandb.enabled=true",
        f"metrics.wandb.dir={offline_wandb}",
    )
    sinks = tracker_sinks(cfg, tmp_path / "run", resumed_step=0)
    assert [type(s).__name__ for s in sinks] == ["MlflowSink", "WandbSink"]
    _replay(sinks, tmp_path / "run")
    for sink in sinks:
        sink.close()

    # Goodput at the recovery: from what the run had recorded by then.
    before = [r for r in METRICS + EVENTS if r["time"] <= RECOVERY["time"]]
    goodput_then = summarize(
        [r for r in before if "event" not in r], [r for r in before if "event" in r]
    )["goodput"]
    client, run = _mlflow_run(uri)
    run_id = run.info.run_id
    history = {
        key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
        for key in ("recovery/seconds", "recovery/lost_steps", "recoveries", "goodput", "loss")
    }
    assert history["recovery/seconds"] == [(3, pytest.approx(RECOVERY["recovery_s"]))]
    assert history["recovery/lost_steps"] == [(3, 0)]
    assert history["recoveries"] == [(3, 1), (5, 1)]  # at the recovery, and the run's end
    assert history["goodput"] == [
        (3, pytest.approx(goodput_then)),
        (5, pytest.approx(summarize(METRICS, EVENTS)["goodput"])),
    ]
    assert history["loss"] == [(m["step"], pytest.approx(m["loss"])) for m in METRICS]
    assert run.data.tags["recovery.1.cause"] == "failed"
    last_checkpoint = [e for e in EVENTS if e["event"] == "checkpoint"][-1]
    assert run.data.metrics["checkpoint/stall_s"] == pytest.approx(last_checkpoint["stall_s"])
    assert run.info.status == "FINISHED"

    (run_file,) = (offline_wandb / "wandb").glob("offline-run-*/run-*.wandb")
    wandb_run = read_wandb_run(run_file)
    (row,) = [r for r in wandb_run.history if "recovery/cause" in r]
    assert row["recovery/cause"] == "failed" and row["step"] == 3
    assert row["recovery/seconds"] == pytest.approx(RECOVERY["recovery_s"])
    assert row["goodput"] == pytest.approx(goodput_then)
    assert [r["world_size"] for r in wandb_run.history if "loss" in r] == [2, 2, 1, 1, 1]
    assert wandb_run.summary["goodput/recovery_s"] == pytest.approx(RECOVERY["recovery_s"])
    assert wandb_run.exit_code == 0


def test_a_resumed_driver_goes_on_in_the_same_tracker_runs(tmp_path, offline_wandb):
    """The driver dies after the failure (no end state: the runs are left FAILED); a new
    driver resumes step 2's checkpoint and logs to the same MLflow and W&B runs."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    overrides = (
        f"metrics.mlflow.tracking_uri={uri}",
        "metrics.wandb.enabled=true",
        f"metrics.wandb.dir={offline_wandb}",
    )
    first = tracker_sinks(_config(tmp_path, *overrides), tmp_path / "run", resumed_step=0)
    _replay(first, tmp_path / "run", until=FAILURE["time"])
    for sink in first:
        sink.close()
    client, run = _mlflow_run(uri)
    assert run.info.status == "FAILED"

    # The next driver: later steps and a changed option (params cannot change: kept as were).
    second = tracker_sinks(
        _config(tmp_path, *overrides, "trainer.steps=6"), tmp_path / "run", resumed_step=2
    )
    _replay(second, tmp_path / "run", after=FAILURE["time"])
    for sink in second:
        sink.close()
    client, resumed = _mlflow_run(uri)  # still one run
    assert resumed.info.run_id == run.info.run_id and resumed.info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "loss")]
    assert steps == [1, 2, 3, 4, 5]
    assert resumed.data.params["trainer.steps"] == "5"

    first_file, second_file = sorted((offline_wandb / "wandb").glob("offline-run-*/run-*.wandb"))
    assert first_file.name == second_file.name  # the same W&B run id, synced as one run
    assert read_wandb_run(first_file).exit_code == 1
    assert [r["step"] for r in read_wandb_run(second_file).history if "loss" in r] == [3, 4, 5]


def test_an_unreachable_mlflow_server_is_switched_off_not_the_run(tmp_path, monkeypatch, caplog):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    cfg = _config(tmp_path, f"metrics.mlflow.tracking_uri=http://127.0.0.1:{port}")
    sink = MlflowSink(cfg, tmp_path / "run", resumed_step=0)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="raytrain_dt.train"):
        _replay([sink], tmp_path / "run")
        sink.close()
    assert time.monotonic() - started < 30
    assert "mlflow switched off: open failed" in caplog.text


def test_the_config_is_flattened_into_params():
    cfg = load_config(
        REPO / "conf" / "test.yaml",
        ["chaos=[{at_step: 2, action: kill_rank}]", "comm.env={NCCL_IB_HCA: mlx5}"],
    )
    params = flat_params(dataclasses.asdict(cfg))
    assert params["trainer.steps"] == "5"
    assert params["run.name"] == "test"
    assert params["parallel.tp"] == "null"
    assert params["resume"] == "true"
    assert params["comm.env.NCCL_IB_HCA"] == "mlx5"
    assert json.loads(params["chaos"]) == [
        {"at_step": 2, "action": "kill_rank", "target": 0, "at": "step"}
    ]
    assert params["metrics.mlflow.tracking_uri"] == "null"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("metrics.mlflow.nope=1", "metrics.mlflow.nope: unknown key"),
        ("metrics.wandb.project_name=x", "metrics.wandb.project_name: unknown key"),
        (
            "metrics.wandb.mode=sometimes",
            "metrics.wandb.mode: 'sometimes' is not one of None, online, offline, disabled",
        ),
        ("metrics.wandb.enabled=perhaps", "metrics.wandb.enabled: 'perhaps' is not a valid bool"),
        ("metrics.mlflow.tracking_uri=''", "metrics.mlflow.tracking_uri: must not be empty"),
        ("metrics.mlflow.experiment=", "metrics.mlflow.experiment: None is not a valid str"),
    ],
)
def test_bad_tracker_options_exit_2_with_one_line(capsys, tmp_path, override, message):
    # (A missing dataset would stop an override let through before it trained.)
    code = main(["train", "conf/tiny.yaml", override, f"run.dir={tmp_path}/r", NO_DATA])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {message}"]
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    ("override", "package", "key"),
    [
        (
            "metrics.mlflow.tracking_uri=http://127.0.0.1:5000",
            "mlflow",
            "metrics.mlflow.tracking_uri",
        ),
        ("metrics.wandb.enabled=true", "wandb", "metrics.wandb.enabled"),
    ],
)
def test_a_tracker_without_its_package_exits_2_naming_the_key(
    capsys, tmp_path, monkeypatch, override, package, key
):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == package else find_spec(name, *a),
    )
    code = main(["train", "conf/tiny.yaml", override, f"run.dir={tmp_path}/r", NO_DATA])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {key}: the {package} package is not installed "
        "(pip install 'raytrain_dt[trackers]')"
    ]
    assert not (tmp_path / "r").exists()


def test_mlflow_and_wandb_are_imported_only_when_configured():
    code = (
        "import sys, raytrain_dt.control.coordinator, raytrain_dt.observe.trackers; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'mlflow', 'wandb'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
