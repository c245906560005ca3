"""Experiment trackers: the run logged to MLflow (`metrics.mlflow`) and Weights & Biases
(`metrics.wandb`), where Ray Train users look for it.

Sinks on the driver, fed the step lines and events that the ranks already report
(`observe/metrics.py`), so the ranks never talk to a tracker. Each logs:

- once: the resolved config as params (MLflow: flattened dotted keys; W&B: its config);
- per step, at the step number: loss, lr, grad_norm, tokens_per_s, step_time_s, data_wait_s,
  mfu (when measured), world_size, global_batch and peak_mem_gib (max over ranks);
- per event: a recovery's seconds, lost steps, lost work and cause, with the run's recovery
  count and goodput so far (`observe/goodput.py`, read from the run directory, the one
  definition); a checkpoint's stall and write time; a rewind's dropped steps;
- at the end: the goodput breakdown and the run's summary, and the tracker run ended as
  FINISHED, KILLED (stopped by SIGTERM, resumable) or FAILED.

One tracker run per driver job: re-formations go on logging to it, and a driver that resumes
the run directory from a checkpoint reopens it (its id is kept in run.dir/trackers/). Steps
trained again after a restart from an older checkpoint are logged again at the same step
number; the later value is the one the model kept (metrics.jsonl has only that one).

mlflow and wandb are imported only when configured. A tracker's calls run on a thread of its
own, in order, so a slow or unreachable server never holds up the driver; a failing tracker is
switched off with a warning, never the run.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raytrain_dt.config.schema import TrainConfig
from raytrain_dt.errors import ConfigError
from raytrain_dt.observe.goodput import summarize
from raytrain_dt.observe.metrics import read_jsonl

log = logging.getLogger("raytrain_dt.train")

# The step line's fields a tracker gets, under the same names.
STEP_KEYS = (
    "loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "step_time_s",
    "data_wait_s",
    "mfu",
    "world_size",
    "global_batch",
)
# The run summary's numbers logged at the end (`goodput.summarize`), besides the breakdown.
SUMMARY_KEYS = (
    "failures",
    "preemptions",
    "resizes",
    "recoveries",
    "checkpoints",
    "lost_steps",
    "mean_tokens_per_s",
    "mean_mfu",
)
# The coordinator's terminal states (its last `transition` event) as MLflow run statuses; a
# driver that ends without one (an exception, Ctrl-C) leaves the run FAILED.
END_STATUS = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}
# How long the end of a run waits for a tracker to take what is queued.
CLOSE_TIMEOUT_S = 60.0

_STOP = object()


def check_installed(cfg: TrainConfig) -> None:
    """A configured tracker whose package is missing stops the run before anything starts."""
    wanted = (
        ("metrics.mlflow.tracking_uri", "mlflow", cfg.metrics.mlflow.tracking_uri is not None),
        ("metrics.wandb.enabled", "wandb", cfg.metrics.wandb.enabled),
    )
    for key, package, on in wanted:
        if on and importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"{key}: the {package} package is not installed "
                f"(pip install 'raytrain_dt[trackers]')"
            )


def tracker_sinks(cfg: TrainConfig, run_dir: Path, resumed_step: int) -> list:
    """The trackers the config turns on (none by default)."""
    check_installed(cfg)
    sinks: list[TrackerSink] = []
    if cfg.metrics.mlflow.tracking_uri is not None:
        sinks.append(MlflowSink(cfg, run_dir, resumed_step))
    if cfg.metrics.wandb.enabled:
        sinks.append(WandbSink(cfg, run_dir, resumed_step))
    return sinks


def flat_params(tree: dict, prefix: str = "") -> dict[str, str]:
    """`{"trainer": {"steps": 5}}` -> `{"trainer.steps": "5"}`: strings as they are, everything
    else as JSON (lists such as `chaos` stay one value)."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat_params(value, f"{name}."))
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value)
    return out


def step_values(record: dict) -> dict[str, float]:
    values = {k: record[k] for k in STEP_KEYS if k in record}
    peaks = [b for b in record.get("mem_peak_bytes", []) if b is not None]
    if peaks:
        values["peak_mem_gib"] = max(peaks) / 2**30
    if "router" in record:  # mixture-of-experts runs: the share of token copies dropped
        values["moe/drop_rate"] = record["router"]["drop_rate"]
    return values


class TrackerSink:
    """A `Sink` whose tracker calls (`_open`, `_log`, `_recovery`, `_finish`) run on a thread
    of its own: the driver's calls only queue them."""

    name = "tracker"

    def __init__(self, cfg: TrainConfig, run_dir: Path, resumed_step: int):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.step = resumed_step  # the newest step line: where events without a step go
        self.status = "FAILED"  # until the coordinator's last transition says otherwise
        # A driver resuming a checkpoint of this run directory goes on in the same run.
        self.resume_id = self._remembered() if resumed_step > 0 else None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=f"{self.name}-tracker", daemon=True)
        self._thread.start()

    # --- the driver's side: the Sink protocol ------------------------------------------------
    def on_step(self, record: dict) -> None:
        self.step = record["step"]
        self._put(self._log, record["step"], step_values(record))

    def on_event(self, e: dict) -> None:
        kind, step = e["event"], e.get("step", self.step)
        if kind == "recovery":
            values = {
                "recovery/seconds": e["recovery_s"],
                "recovery/lost_steps": e["lost_steps"],
                "recovery/lost_work_s": e["lost_work_s"],
            }
            summary = self.summary()
            values.update(recoveries=summary["recoveries"], goodput=summary["goodput"])
            self._put(self._recovery, step, values, e["cause"], summary["recoveries"])
        elif kind == "checkpoint":
            values = {"checkpoint/stall_s": e["stall_s"], "checkpoint/write_s": e["write_s"]}
            self._put(self._log, step, values)
        elif kind == "rewind":
            self._put(self._log, step, {"rewind/dropped_steps": len(e["dropped_steps"])})
        elif kind == "transition" and e["new"] in END_STATUS:
            self.status = END_STATUS[e["new"]]

    def on_rewind(self, step: int) -> None:
        pass  # the rewind event says it; a tracker keeps what it was sent

    def close(self) -> None:
        final: dict = {}
        try:
            summary = self.summary()
            final = {f"goodput/{k}": v for k, v in summary.items() if k.endswith("_s")}
            final.update({k: summary[k] for k in SUMMARY_KEYS if summary[k] is not None})
            final["goodput"] = summary["goodput"]
        except Exception as exc:  # records it cannot read: the tracker run still ends
            log.warning("%s: no run summary (%s: %s)", self.name, type(exc).__name__, exc)
        self._put(self._finish, self.status, self.step, final)
        self._queue.put(_STOP)
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            log.warning(
                "%s: still busy after %.0fs at the end of the run; what it has not sent is lost",
                self.name,
                CLOSE_TIMEOUT_S,
            )

    def summary(self) -> dict:
        """The run's goodput and counts so far, from its records (`goodput.summarize`)."""
        return summarize(
            read_jsonl(self.run_dir / "metrics.jsonl"), read_jsonl(self.run_dir / "events.jsonl")
        )

    # --- the tracker's thread ----------------------------------------------------------------
    def _put(self, call: Callable, *args: Any) -> None:
        self._queue.put((call, args))

    def _work(self) -> None:
        call: Callable = self._open
        try:
            self._open()
            while (item := self._queue.get()) is not _STOP:
                call, args = item
                call(*args)
        except Exception as exc:  # a tracker must never stop training
            log.warning(
                "%s switched off: %s failed (%s: %s)",
                self.name,
                call.__name__.lstrip("_"),
                type(exc).__name__,
                exc,
            )
            while self._queue.get() is not _STOP:
                pass  # what was queued has nowhere to go

    def _remembered(self) -> str | None:
        path = self.run_dir / "trackers" / f"{self.name}.json"
        if not path.exists():
            return None
        kept = json.loads(path.read_text())
        return kept["run_id"] if kept.get("where") == self._where() else None

    def _remember(self, run_id: str) -> None:
        path = self.run_dir / "trackers" / f"{self.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"run_id": run_id, "where": self._where()}) + "\n")

    # --- what each tracker does, on its thread -----------------------------------------------
    def _where(self) -> str:
        """What a remembered run id is valid for (a run in another place is not resumed)."""
        raise NotImplementedError

    def _open(self) -> None:
        raise NotImplementedError

    def _log(self, step: int, values: dict) -> None:
        raise NotImplementedError

    def _recovery(self, step: int, values: dict, cause: str, number: int) -> None:
        raise NotImplementedError

    def _finish(self, status: str, step: int, summary: dict) -> None:
        raise NotImplementedError


class MlflowSink(TrackerSink):
    """One MLflow run in `metrics.mlflow.experiment`, on the tracking server's REST API."""

    name = "mlflow"
    # MLflow's limits on one param value and on params per log_batch call.
    MAX_PARAM_CHARS, PARAMS_PER_BATCH = 6000, 100

    def _where(self) -> str:
        m = self.cfg.metrics.mlflow
        return f"{m.tracking_uri} {m.experiment}"

    def _open(self) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        m = self.cfg.metrics.mlflow
        self.client = client = MlflowClient(m.tracking_uri)
        logged: dict[str, str] = {}
        if self.resume_id:
            self.run_id = self.resume_id
            client.update_run(self.run_id, status="RUNNING")
            logged = client.get_run(self.run_id).data.params
        else:
            experiment = client.get_experiment_by_name(m.experiment)
            experiment_id = (
                experiment.experiment_id if experiment else client.create_experiment(m.experiment)
            )
            run = client.create_run(
                experiment_id,
                run_name=m.run_name or self.cfg.run.name,
                tags={"raytrain_dt.run_dir": str(self.run_dir.resolve())},
            )
            self.run_id = run.info.run_id
            self._remember(self.run_id)
        # Params cannot change once logged: a resumed run adds only keys new to it.
        params = [
            Param(k, v[: self.MAX_PARAM_CHARS])
            for k, v in flat_params(dataclasses.asdict(self.cfg)).items()
            if k not in logged
        ]
        for i in range(0, len(params), self.PARAMS_PER_BATCH):
            client.log_batch(self.run_id, params=params[i : i + self.PARAMS_PER_BATCH])

    def _log(self, step: int, values: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, step) for k, v in values.items() if v is not None]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def _recovery(self, step: int, values: dict, cause: str, number: int) -> None:
        self._log(step, values)
        self.client.set_tag(self.run_id, f"recovery.{number}.cause", cause)

    def _finish(self, status: str, step: int, summary: dict) -> None:
        self._log(step, summary)
        self.client.set_terminated(self.run_id, status)


class WandbSink(TrackerSink):
    """One W&B run; every metric is plotted against `step` (the optimizer step), so steps
    trained again after a restart do not fall foul of W&B's ever-growing internal step."""

    name = "wandb"
    # W&B's run exit codes for the coordinator's ends (KILLED: as `raytrain-dt train`, 128 + 15).
    EXIT_CODES = {"FINISHED": 0, "KILLED": 143, "FAILED": 1}

    def _where(self) -> str:
        w = self.cfg.metrics.wandb
        return f"{w.entity} {w.project}"

    def _open(self) -> None:
        import wandb

        w = self.cfg.metrics.wandb
        files = Path(w.dir or self.run_dir)
        files.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=w.project,
            entity=w.entity,
            name=w.run_name or self.cfg.run.name,
            dir=str(files),
            mode=w.mode,
            id=self.resume_id,  # null: W&B picks a new one
            resume="allow" if self.resume_id else None,
            config=dataclasses.asdict(self.cfg),
            # This process may run other W&B runs; and the driver's console is not W&B's to
            # capture (train.log in the run directory has it).
            reinit="create_new",
            settings=wandb.Settings(console="off"),
        )
        if not self.resume_id:
            self._remember(self.run.id)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def _log(self, step: int, values: dict) -> None:
        self.run.log({"step": step, **values})

    def _recovery(self, step: int, values: dict, cause: str, number: int) -> None:
        self.run.log({"step": step, **values, "recovery/cause": cause})

    def _finish(self, status: str, step: int, summary: dict) -> None:
        self.run.summary.update(summary)
        self.run.finish(exit_code=self.EXIT_CODES[status])
