"""Run records on the driver: `metrics.jsonl` (one line per optimizer step), `ledger.jsonl`
(which samples each step consumed), and `events.jsonl`.

Lines are appended and flushed as they come, so a crashed run keeps everything up to its last
step. On resume, records past the resumed step are dropped: those steps are trained again.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


class JsonlLog:
    def __init__(self, path: Path):
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - held for the run's life

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()


def truncate_after_step(path: Path, step: int) -> None:
    """Keep only records with `step` <= step (and records without a step)."""
    if not path.exists():
        return
    kept = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line).get("step", 0) <= step
    ]
    path.write_text("".join(line + "\n" for line in kept))


def read_jsonl(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class RunRecorder:
    """Collects per-rank reports into whole-step records."""

    def __init__(self, run_dir: Path, resumed_step: int):
        for name in ("metrics.jsonl", "ledger.jsonl"):
            truncate_after_step(run_dir / name, resumed_step)
        self.metrics = JsonlLog(run_dir / "metrics.jsonl")
        self.ledger = JsonlLog(run_dir / "ledger.jsonl")
        self.events = JsonlLog(run_dir / "events.jsonl")
        self._pending_ids: dict[int, dict[int, list[int]]] = {}
        self.last_metrics: dict = {}

    def rewind(self, step: int) -> None:
        """Forget step records after `step`: a restart from that checkpoint trains them again."""
        for log in (self.metrics, self.ledger):
            log.close()
            truncate_after_step(log.path, step)
        self.metrics = JsonlLog(self.metrics.path)
        self.ledger = JsonlLog(self.ledger.path)
        self._pending_ids.clear()

    def event(self, kind: str, **fields) -> None:
        self.events.write({"time": time.time(), "event": kind, **fields})

    def step_metrics(self, record: dict, world_size: int, layout: str) -> None:
        out = {
            k: record[k]
            for k in (
                "step",
                "loss",
                "lr",
                "grad_norm",
                "tokens_per_s",
                "step_time_s",
                "data_wait_s",
                "consumed_samples",
            )
        }
        out.update(world_size=world_size, layout=layout, time=time.time())
        self.metrics.write(out)
        self.last_metrics = out

    def step_samples(self, step: int, dp_rank: int, num_dp: int, ids: list[int]) -> None:
        pending = self._pending_ids.setdefault(step, {})
        pending[dp_rank] = ids
        if len(pending) == num_dp:
            ordered = [i for r in range(num_dp) for i in pending[r]]
            self.ledger.write({"step": step, "sample_ids": ordered})
            del self._pending_ids[step]

    def close(self) -> None:
        for log in (self.metrics, self.ledger, self.events):
            log.close()
