"""`raytrain-dt status` on the session cluster: a coordinator training in a thread publishes its
status; a reader sees it live, step by step, equal to what metrics.jsonl records, and `--all`
lists it while it runs; when the run ends its record leaves Ray's KV store, and the CLI,
joining the cluster as a separate driver, says the run is no longer live.
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


def test_status_follows_a_running_job(ray_cluster, make_config, monkeypatch, caplog, capsys):
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
    listed = ""
    while thread.is_alive():
        records = status.read_statuses(str(run_dir))
        if records and records[0]["state"] == "running" and records[0]["step"] >= 1:
            seen.append(records[0])
            if not listed:  # `raytrain-dt status --all` on the same cluster, while it runs
                status.show_status(None, None, every=True)
                listed = capsys.readouterr().out
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

    assert f"run  status_test  ({run_dir})" in listed and "running" in listed
    assert any(r["last_event"] for r in seen)

    # The run has ended: its record is gone from the KV store, by directory and by name.
    assert status.read_statuses(str(run_dir)) == status.read_statuses("status_test") == []
    cli = Path(sys.executable).parent / "raytrain-dt"
    out = subprocess.run(
        [str(cli), "status", "--address", ray_cluster.address, str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"error: RUN: no live raytrain_dt run {run_dir} on this cluster (a run's status goes "
        "when it ends: `raytrain-dt report RUN_DIR` summarizes an ended one)"
    )
