"""Run records on the driver: `metrics.jsonl` (one line per optimizer step), `ledger.jsonl`
(which samples each step consumed), and `events.jsonl`; and the exporters fed from them.

Lines are appended and flushed as they come, so a crashed run keeps everything up to its last
step. On resume, records past the resumed step are dropped: those steps are trained again, and
a `rewind` event says which and how much compute they had cost (the run report's lost work).
A step's line is written once rank 0's metrics and every rank's memory for it have arrived.
Every step line and event also goes to the sinks (console, TensorBoard, Ray metrics, status);
a failing sink is switched off with a warning, never the run.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from raytrain_dt.observe.recovery_tracker import RecoveryTracker

log = logging.getLogger(__name__)

STEP_FIELDS = (
    "step",
    "loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "step_time_s",
    "data_wait_s",
    "consumed_samples",
    "mfu",
    "global_batch",
    "router",
)


class Sink(Protocol):
    def on_step(self, record: dict) -> None: ...
    def on_event(self, record: dict) -> None: ...
    def on_rewind(self, step: int) -> None: ...
    def close(self) -> None: ...


class JsonlLog:
    def __init__(self, path: Path):
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - held for the run's life

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()


def truncate_after_step(path: Path, step: int) -> list[dict]:
    """Keep only records with `step` <= step (and records without a step); return the rest."""
    if not path.exists():
        return []
    kept, dropped = [], []
    for line in path.read_text().splitlines():
        if line.strip():
            (kept if json.loads(line).get("step", 0) <= step else dropped).append(line)
    path.write_text("".join(line + "\n" for line in kept))
    return [json.loads(line) for line in dropped]


def read_jsonl(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class RunRecorder:
    """Collects per-rank reports into whole-step records and hands them to the sinks."""

    def __init__(self, run_dir: Path, resumed_step: int, sinks: Sequence[Sink] = ()):
        self.sinks = list(sinks)
        # What an earlier driver session trained, for the recovery across a driver restart.
        self.recovery = RecoveryTracker.from_history(
            read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "events.jsonl")
        )
        dropped = truncate_after_step(run_dir / "metrics.jsonl", resumed_step)
        truncate_after_step(run_dir / "ledger.jsonl", resumed_step)
        self.metrics = JsonlLog(run_dir / "metrics.jsonl")
        self.ledger = JsonlLog(run_dir / "ledger.jsonl")
        self.events = JsonlLog(run_dir / "events.jsonl")
        self._pending_ids: dict[int, dict[int, list[int]]] = {}
        self._pending_steps: dict[int, dict] = {}
        self._pending_memory: dict[int, dict[int, tuple]] = {}
        self.last_metrics: dict = {}
        self.event("session", resumed_step=resumed_step)
        self._record_rewind(resumed_step, dropped)

    def rewind(self, step: int) -> None:
        """Forget step records after `step`: a restart from that checkpoint trains them again."""
        self._flush(upto=step)
        dropped = [r for s, r in sorted(self._pending_steps.items()) if s > step]
        self._pending_steps.clear()
        self._pending_memory.clear()
        self._pending_ids.clear()
        self.metrics.close()
        self.ledger.close()
        dropped = truncate_after_step(self.metrics.path, step) + dropped
        truncate_after_step(self.ledger.path, step)
        self.metrics = JsonlLog(self.metrics.path)
        self.ledger = JsonlLog(self.ledger.path)
        self._record_rewind(step, dropped)
        self._each_sink("on_rewind", step)

    def _record_rewind(self, step: int, dropped: list[dict]) -> None:
        lost_s = sum(r["step_time_s"] for r in dropped)
        self.recovery.on_rewind(step, len(dropped), lost_s)
        if not dropped:
            return
        self.event(
            "rewind",
            step=step,
            dropped_steps=[r["step"] for r in dropped],
            dropped_step_time_s=lost_s,
        )

    def event(self, kind: str, **fields) -> None:
        record = {"time": time.time(), "event": kind, **fields}
        self.events.write(record)
        self._each_sink("on_event", record)
        self.recovery.on_event(record)

    def model_built(self, rank_setup: list[dict]) -> None:
        """The `model_built` event of a formation: the ranks' host memory after building the
        model (`rank_setup`, in rank order, as `RankWorker.setup` returns it): the max over
        ranks of the peak, and per rank the idle actor's RSS and the peak since."""
        peaks = [r.get("host_rss_peak_bytes") for r in rank_setup]
        if any(p is None for p in peaks):
            return  # ranks that do not measure (test fakes)
        self.event(
            "model_built",
            host_rss_peak_bytes=max(peaks),
            rank_host_rss_peak_bytes=peaks,
            rank_host_rss_idle_bytes=[r["host_rss_idle_bytes"] for r in rank_setup],
            model_build_s=max(r["model_build_s"] for r in rank_setup),
        )

    def step_metrics(self, record: dict, world_size: int, layout: str) -> None:
        """Rank 0's metrics for a step; the line waits for every rank's memory."""
        out = {k: record[k] for k in STEP_FIELDS if k in record}
        out.update(world_size=world_size, layout=layout, time=time.time())
        recovered = self.recovery.on_step(out)
        if recovered:
            self.event(recovered.pop("event"), **recovered)
        self._pending_steps[out["step"]] = out
        self._flush()

    def rank_step(self, rank: int, report: dict) -> None:
        """Any rank's step report: its memory joins the step's line."""
        if "mem_allocated_bytes" in report:
            host = report.get("host_rss_peak_bytes")
            memory = (report["mem_allocated_bytes"], report["mem_peak_bytes"], host)
            self._pending_memory.setdefault(report["step"], {})[rank] = memory
            self._flush()

    def _flush(self, upto: int | None = None) -> None:
        """Write complete step lines in step order; with `upto`, also incomplete ones up to
        that step (a rank that died or hung after reporting its metrics sends no memory)."""
        for step in sorted(self._pending_steps):
            out = self._pending_steps[step]
            memory = self._pending_memory.get(step, {})
            if len(memory) < out["world_size"] and (upto is None or step > upto):
                return
            out["mem_allocated_bytes"] = [
                memory.get(r, (None, None))[0] for r in range(out["world_size"])
            ]
            out["mem_peak_bytes"] = [
                memory.get(r, (None, None))[1] for r in range(out["world_size"])
            ]
            host = [m[2] for m in memory.values() if m[2] is not None]
            if host:  # the host's high-water mark, whatever the compute device: max over ranks
                out["host_rss_peak_bytes"] = max(host)
            self.metrics.write(out)
            self.last_metrics = out
            del self._pending_steps[step]
            self._pending_memory.pop(step, None)
            self._each_sink("on_step", out)

    def step_samples(self, step: int, dp_rank: int, num_dp: int, ids: list[int]) -> None:
        pending = self._pending_ids.setdefault(step, {})
        pending[dp_rank] = ids
        if len(pending) == num_dp:
            ordered = [i for r in range(num_dp) for i in pending[r]]
            self.ledger.write({"step": step, "sample_ids": ordered})
            del self._pending_ids[step]

    def _each_sink(self, method: str, *args) -> None:
        for sink in list(self.sinks):
            try:
                getattr(sink, method)(*args)
            except Exception as exc:  # an exporter must never stop training
                log.warning(
                    "%s failed (%s: %s); switching it off",
                    type(sink).__name__,
                    type(exc).__name__,
                    exc,
                )
                self.sinks.remove(sink)

    def close(self) -> None:
        self._flush(upto=max(self._pending_steps, default=0))
        for log_ in (self.metrics, self.ledger, self.events):
            log_.close()
        self._each_sink("close")
