"""Live status of running jobs, through the cluster: `raytrain-dt status [--address A]
[RUN | --all]`.

The coordinator's `StatusPublisher` (a sink of the run recorder) keeps one small JSON record per
run in Ray's internal key-value store (the GCS), keyed by the run directory: state, step,
layout, world size, loss, tokens/s, MFU and the last event. It writes on every event and at
most once a second for steps, so it costs the run nothing measurable. The record lives as long
as the run: the coordinator's end (finished, failed, stopped or interrupted) closes the
recorder, which removes it, so the store holds only live runs. A killed driver cannot remove
its record; it stays, flagged as not updated, until a driver resumes that run.dir (same key)
and removes it at its own end. `status` joins the cluster as a short-lived driver, reads the
records and prints them.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from raytrain_dt.config.schema import TrainConfig

NAMESPACE = "raytrain_dt"
KEY_PREFIX = "status:"
STEP_PUBLISH_INTERVAL_S = 1.0
# Events the status shows as "last event": what changed, not routine bookkeeping.
NOTABLE = {
    "decision",
    "failure",
    "preemption_notice",
    "resize",
    "start",
    "drained",
    "checkpoint",
    "checkpoint_failed",
    "checkpoint_damaged",
    "recovery",
}


def _kv():
    from ray.experimental import internal_kv

    return internal_kv


class StatusPublisher:
    def __init__(self, cfg: TrainConfig, run_dir: Path):
        self.key = KEY_PREFIX + str(run_dir.resolve())
        self.status: dict = {
            "run": cfg.run.name,
            "dir": str(run_dir.resolve()),
            "state": "starting",
            "total_steps": cfg.trainer.steps,
            "step": 0,
            "last_event": None,
        }
        self._published = 0.0
        self._publish()

    def _publish(self) -> None:
        self.status["updated"] = time.time()
        _kv()._internal_kv_put(
            self.key, json.dumps(self.status), overwrite=True, namespace=NAMESPACE
        )
        self._published = time.monotonic()

    def on_step(self, r: dict) -> None:
        self.status.update(
            {k: r.get(k) for k in ("step", "loss", "tokens_per_s", "mfu", "world_size", "layout")}
        )
        if time.monotonic() - self._published >= STEP_PUBLISH_INTERVAL_S:
            self._publish()

    def on_event(self, e: dict) -> None:
        if e["event"] == "transition":
            self.status["state"] = e["new"]
        elif e["event"] in NOTABLE:
            self.status["last_event"] = e
        else:
            return
        self._publish()

    def on_rewind(self, step: int) -> None:
        self.status["step"] = step

    def close(self) -> None:
        """The run has ended: its record goes (what it ended with is in run.dir)."""
        _kv()._internal_kv_del(self.key, namespace=NAMESPACE)


def read_statuses(run: str | None = None) -> list[dict]:
    """Live runs' status records on the connected cluster, newest first; `run` selects by run
    directory or name."""
    keys = _kv()._internal_kv_list(KEY_PREFIX, namespace=NAMESPACE)
    values = [_kv()._internal_kv_get(k, namespace=NAMESPACE) for k in keys]
    # A run that ended between the listing and the read has no value any more.
    records = [json.loads(v) for v in values if v is not None]
    if run is not None:
        wanted = str(Path(run).resolve())
        records = [r for r in records if r["dir"] == wanted or r["run"] == run]
    return sorted(records, key=lambda r: r["updated"], reverse=True)


def describe_event(e: dict | None) -> str:
    if not e:
        return "-"
    details = {
        k: e[k]
        for k in ("step", "cause", "reason", "health", "recovery_s", "lost_steps")
        if e.get(k) is not None
    }
    text = ", ".join(
        f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in details.items()
    )
    age = time.time() - e["time"]
    return f"{e['event']} ({text}) {age:.0f}s ago"


def format_status(r: dict) -> str:
    age = time.time() - r["updated"]
    stale = ""
    if r["state"] not in ("finished", "failed") and age > 30:
        # An ended run removes its record; one left behind is a killed driver's.
        stale = f"  (no update for {age:.0f}s: is the driver still running?)"
    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
    tok_s = f"{r['tokens_per_s']:.0f}" if r.get("tokens_per_s") is not None else "-"
    loss = f"{r['loss']:.4f}" if r.get("loss") is not None else "-"
    rows = [
        ("run", f"{r['run']}  ({r['dir']})"),
        ("state", r["state"] + stale),
        ("step", f"{r['step']}/{r['total_steps']}"),
        ("layout", f"world {r.get('world_size', '-')}: {r.get('layout') or '-'}"),
        ("loss", loss),
        ("tokens/s", f"{tok_s}  (MFU {mfu})"),
        ("last event", describe_event(r.get("last_event"))),
    ]
    return "\n".join(f"{name:>10}  {value}" for name, value in rows)


def show_status(address: str | None, run: str | None, every: bool = False) -> int:
    """The `status` command: join the cluster and print `run`'s status, every live run's
    (`every`, `--all`), or with neither the most recently updated live run's."""
    import ray

    from raytrain_dt.errors import UserError

    joined = not ray.is_initialized()
    if joined:
        address = address or os.environ.get("RAY_ADDRESS") or "auto"
        try:
            ray.init(
                address=address,
                namespace=NAMESPACE,
                log_to_driver=False,
                logging_level="WARNING",
                configure_logging=False,
            )
        except (ConnectionError, RuntimeError) as exc:
            raise UserError(f"--address: cannot reach a Ray cluster at {address}: {exc}") from exc
    try:
        records = read_statuses(run)
    finally:
        if joined:
            ray.shutdown()
    if every and not records:
        print("no live raytrain_dt runs on this cluster")
        return 0
    if not records:
        if run:
            raise UserError(
                f"RUN: no live raytrain_dt run {run} on this cluster (a run's status goes when it "
                f"ends: `raytrain-dt report RUN_DIR` summarizes an ended one)"
            )
        raise UserError("no live raytrain_dt run on this cluster")
    shown = records if every or run else records[:1]
    print("\n\n".join(format_status(r) for r in shown))
    if len(records) > len(shown):
        print(f"\n({len(records) - len(shown)} more live runs: raytrain-dt status --all)")
    return 0
