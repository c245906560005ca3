"""Where a run's wall-clock time went, and the run's summary, from its records alone.

The one definition of the goodput breakdown (seconds, from `events.jsonl` and `metrics.jsonl`):

- wall: from the first `session` event (the driver connected to Ray) to the newest record.
- productive: the step time (rank 0's data wait + forward/backward/optimizer) of every step in
  metrics.jsonl, i.e. of the steps the final model is made of.
- checkpoint stall: the `stall_s` of every committed `checkpoint` event: how long training
  waited for the slowest rank to stage its shards (the write itself runs in the background).
- recovery: the `recovery_s` of every `recovery` event (see `observe/recovery_tracker.py`): from the
  end of the last step before an interruption to the start of the first step after it.
- lost work: the step time of steps trained and then discarded because the group resumed from
  an older checkpoint (`dropped_step_time_s` of the `rewind` events).
- startup: the `startup_s` of the `startup` event: driver start to the first step's start.
- other: the rest of the wall time: per-step overheads outside the step time (reporting,
  polling, injected chaos delays) and the wait for the last checkpoint's write at the end.

Goodput = productive / wall.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Goodput:
    wall_s: float
    productive_s: float
    checkpoint_stall_s: float
    recovery_s: float
    lost_work_s: float
    startup_s: float
    other_s: float

    @property
    def fraction(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    def parts(self) -> dict[str, float]:
        """The categories that add up to the wall time."""
        return {k: v for k, v in asdict(self).items() if k != "wall_s"}


def _of(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["event"] == kind]


def goodput(metrics: list[dict], events: list[dict]) -> Goodput:
    sessions = _of(events, "session")
    times = [r["time"] for r in events + metrics]
    start = sessions[0]["time"] if sessions else min(times, default=0.0)
    wall = max(times, default=start) - start
    parts = {
        "productive_s": sum(m["step_time_s"] for m in metrics),
        "checkpoint_stall_s": sum(e["stall_s"] for e in _of(events, "checkpoint")),
        "recovery_s": sum(e["recovery_s"] for e in _of(events, "recovery")),
        "lost_work_s": sum(e["dropped_step_time_s"] for e in _of(events, "rewind")),
        "startup_s": sum(e["startup_s"] for e in _of(events, "startup")),
    }
    return Goodput(wall_s=wall, other_s=wall - sum(parts.values()), **parts)


def summarize(metrics: list[dict], events: list[dict]) -> dict:
    """Every number the report and the terminal summary show."""
    good = goodput(metrics, events)
    peaks = [b for m in metrics for b in m.get("mem_peak_bytes", []) if b is not None]
    mfus = [m["mfu"] for m in metrics if "mfu" in m]
    world_sizes: list[int] = []
    for e in _of(events, "start") + _of(events, "resize"):
        size = e["new_layout"]["dims"]["world_size"]
        if not world_sizes or world_sizes[-1] != size:
            world_sizes.append(size)
    return {
        "steps": metrics[-1]["step"] if metrics else 0,
        "final_loss": metrics[-1]["loss"] if metrics else None,
        "goodput": good.fraction,
        **asdict(good),
        "failures": len(_of(events, "failure")),
        "preemptions": len(_of(events, "preemption_notice")),
        "resizes": len(_of(events, "resize")),
        "recoveries": len(_of(events, "recovery")),
        "checkpoints": len(_of(events, "checkpoint")),
        "lost_steps": sum(len(e["dropped_steps"]) for e in _of(events, "rewind")),
        "mean_tokens_per_s": sum(m["tokens_per_s"] for m in metrics) / len(metrics)
        if metrics
        else 0.0,
        "mean_mfu": sum(mfus) / len(mfus) if mfus else None,
        "peak_memory_bytes": max(peaks, default=None),
        "world_sizes": world_sizes,
    }
