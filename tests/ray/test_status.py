"""`raytrain-dt status` on the session cluster: a coordinator training in a thread publishes its
status; a reader sees it live, step by step, equal to what metrics.jsonl records; and the CLI,
joining the cluster as a separate driver, shows the finished run.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from report_checks import check_step_metrics

from raytrain_dt.control.coordinator import train
from raytrain_dt.observe import status
from raytrain_dt.observe.metrics import read_jsonl


def test_status_follows_a_running_job(ray_cluster, make_config, monkeypatch, caplog):
    # Publish every step (not once a second), so a short run shows every state it passes.
    monkeypatch.setattr(status, "STEP_PUBLISH_INTERVAL_S", 0.0)
    cfg = make_config("trainer.steps=8", "run.name=status_test", "checkpoint.every_steps=4")
    run_dir = Path(cfg.run.dir).resolve()
    outcome: dict = {}
    thread = threading.Thread(
        target=lambda: outcome.update(result=train(cfg, show_progress=False)), daemon=True
    )
    thread.start()
    seen: list[dict] = []
    while thread.is_alive():
        records = status.read_statuses(str(run_dir))
        if records and records[0]["state"] == "running" and records[0]["step"] >= 1:
            seen.append(records[0])
        time.sleep(0.05)
    thread.join()
    assert "result" in outcome, "training failed"
    # Every exporter (Ray metrics, status) ran the whole run without being switched off.
    assert "switching it off" not in caplog.text and "exporter not started" not in caplog.text

    metrics = {m["step"]: m for m in check_step_metrics(cfg, run_dir)}
    assert seen, "no status was published while the job was running"
    for record in seen:  # what the status said at step k is what metrics.jsonl says of step k
        line = metrics[record["step"]]
        for key in ("loss", "tokens_per_s", "mfu", "world_size", "layout"):
            assert record[key] == line[key], key

    (final,) = status.read_statuses("status_test")  # by run name too
    events = read_jsonl(run_dir / "events.jsonl")
    assert final["state"] == "finished" and final["step"] == cfg.trainer.steps == max(metrics)
    assert final["last_event"] == [e for e in events if e["event"] in status.NOTABLE][-1]

    cli = Path(sys.executable).parent / "raytrain-dt"
    out = subprocess.run(
        [str(cli), "status", "--address", ray_cluster.address, str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "finished" in out.stdout and f"{cfg.trainer.steps}/{cfg.trainer.steps}" in out.stdout
    assert final["layout"] in out.stdout and f"{final['loss']:.4f}" in out.stdout
