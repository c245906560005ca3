"""Where step lines and events go besides the jsonl files: the driver's log (rank 0's metrics,
every `trainer.log_every` steps), TensorBoard event files (`trainer.tensorboard`), Ray metrics
(so they reach the Ray dashboard's Prometheus and Grafana), the live status, and experiment
trackers (`metrics.*`, `observe/trackers.py`).

All run on the driver from what the ranks already report, so the train step makes no Ray call.
"""

from __future__ import annotations

import logging
from pathlib import Path

from raytrain_dt.config.schema import TrainConfig
from raytrain_dt.observe.metrics import Sink
from raytrain_dt.observe.trackers import tracker_sinks

log = logging.getLogger("raytrain_dt.train")

GIB = 2**30


def _peak_gib(record: dict) -> float:
    return max((b for b in record.get("mem_peak_bytes", []) if b is not None), default=0) / GIB


class ConsoleLog:
    """Rank 0's step metrics and the events a user wants to see, as log lines."""

    def __init__(self, every: int, total_steps: int):
        self.every, self.total = every, total_steps

    def on_step(self, r: dict) -> None:
        if r["step"] % self.every and r["step"] != self.total:
            return
        mfu = f" | mfu {100 * r['mfu']:.1f}%" if "mfu" in r else ""
        log.info(
            "step %d/%d | loss %.4f | lr %.2e | grad norm %.3f | %.0f tok/s%s | "
            "peak mem %.2f GiB | world %d",
            r["step"],
            self.total,
            r["loss"],
            r["lr"],
            r["grad_norm"],
            r["tokens_per_s"],
            mfu,
            _peak_gib(r),
            r["world_size"],
        )

    def on_event(self, e: dict) -> None:
        if e["event"] == "checkpoint":
            log.info(
                "checkpoint at step %d committed (stall %.2fs, write %.2fs)",
                e["step"],
                e["stall_s"],
                e["write_s"],
            )
        elif e["event"] == "recovery":
            log.info(
                "recovered from %s in %.1fs: resumed at step %d, %d steps lost",
                e["cause"],
                e["recovery_s"],
                e["resumed_step"],
                e["lost_steps"],
            )

    def on_rewind(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardWriter:
    """Scalars per step under train/, perf/, memory/ and events per step under events/."""

    def __init__(self, log_dir: Path, resumed_step: int):
        self.log_dir = log_dir
        self._files = 0
        self._open(resumed_step)

    def _open(self, step: int) -> None:
        from tensorboardX import SummaryWriter

        # purge_step makes TensorBoard drop what was logged earlier for the steps from here on
        # (they are trained again). The suffix keeps two files opened in one second apart.
        self._files += 1
        self._step = step
        self.writer = SummaryWriter(
            str(self.log_dir), purge_step=step + 1, filename_suffix=f".{self._files}"
        )

    def on_step(self, r: dict) -> None:
        self._step = step = r["step"]
        for key in ("loss", "lr", "grad_norm"):
            self.writer.add_scalar(f"train/{key}", r[key], step)
        for key in ("tokens_per_s", "step_time_s", "data_wait_s", "mfu"):
            if key in r:
                self.writer.add_scalar(f"perf/{key}", r[key], step)
        self.writer.add_scalar("cluster/world_size", r["world_size"], step)
        if "router" in r:  # mixture-of-experts runs
            self.writer.add_scalar("moe/drop_rate", r["router"]["drop_rate"], step)
            for expert, tokens in enumerate(r["router"]["tokens_per_expert"]):
                self.writer.add_scalar(f"moe/expert{expert}_tokens", tokens, step)
        for rank, (now, peak) in enumerate(zip(r["mem_allocated_bytes"], r["mem_peak_bytes"])):
            if now is not None:
                self.writer.add_scalar(f"memory/rank{rank}_allocated_gib", now / GIB, step)
                self.writer.add_scalar(f"memory/rank{rank}_peak_gib", peak / GIB, step)

    def on_event(self, e: dict) -> None:
        if e["event"] == "checkpoint":
            self.writer.add_scalar("events/checkpoint_stall_s", e["stall_s"], e["step"])
        elif e["event"] == "recovery":
            self.writer.add_scalar("events/recovery_s", e["recovery_s"], e["step"])
            self.writer.add_scalar("events/lost_steps", e["lost_steps"], e["step"])

    def on_rewind(self, step: int) -> None:
        if step < self._step:
            self.writer.close()
            self._open(step)

    def close(self) -> None:
        self.writer.close()


class RayMetrics:
    """Gauges for the latest step and counters for events, tagged with the run name."""

    def __init__(self, run_name: str):
        from ray.util.metrics import Counter, Gauge

        self.tags = {"run": run_name}
        self.gauges = {
            k: Gauge(f"raytrain_dt_{k}", f"latest step's {k}", ("run",))
            for k in (
                "step",
                "loss",
                "lr",
                "grad_norm",
                "tokens_per_s",
                "step_time_s",
                "mfu",
                "world_size",
            )
        }
        self.memory = {
            k: Gauge(f"raytrain_dt_{k}", f"{k} per rank", ("run", "rank"))
            for k in ("mem_allocated_bytes", "mem_peak_bytes")
        }
        self.counters = {
            k: Counter(f"raytrain_dt_{k}", f"{k} since the driver started", ("run",))
            for k in (
                "failures",
                "preemptions",
                "resizes",
                "checkpoints",
                "checkpoint_stall_s",
                "recovery_s",
                "lost_steps",
            )
        }

    def on_step(self, r: dict) -> None:
        for key, gauge in self.gauges.items():
            if key in r:
                gauge.set(r[key], tags=self.tags)
        for key, gauge in self.memory.items():
            for rank, value in enumerate(r[key]):
                if value is not None:
                    gauge.set(value, tags={**self.tags, "rank": str(rank)})

    def on_event(self, e: dict) -> None:
        kind, count = e["event"], self.counters
        if kind == "failure":
            count["failures"].inc(1, tags=self.tags)
        elif kind == "preemption_notice":
            count["preemptions"].inc(1, tags=self.tags)
        elif kind == "resize":
            count["resizes"].inc(1, tags=self.tags)
        elif kind == "checkpoint":
            count["checkpoints"].inc(1, tags=self.tags)
            if e["stall_s"] > 0:
                count["checkpoint_stall_s"].inc(e["stall_s"], tags=self.tags)
        elif kind == "recovery":
            if e["recovery_s"] > 0:  # Ray counters take positive increments only
                count["recovery_s"].inc(e["recovery_s"], tags=self.tags)
            if e["lost_steps"]:
                count["lost_steps"].inc(e["lost_steps"], tags=self.tags)

    def on_rewind(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


def default_sinks(cfg: TrainConfig, run_dir: Path, resumed_step: int) -> list[Sink]:
    """The exporters a run gets: console always; TensorBoard and experiment trackers when
    asked; Ray metrics and the live status when connected to Ray."""
    sinks: list[Sink] = [ConsoleLog(cfg.trainer.log_every, cfg.trainer.steps)]
    if cfg.trainer.tensorboard:
        sinks.append(TensorBoardWriter(run_dir / "tensorboard", resumed_step))
    sinks += tracker_sinks(cfg, run_dir, resumed_step)
    import ray

    if ray.is_initialized():
        from raytrain_dt.observe.status import StatusPublisher

        for make in (lambda: RayMetrics(cfg.run.name), lambda: StatusPublisher(cfg, run_dir)):
            try:
                sinks.append(make())
            except Exception as exc:  # an exporter must never stop training
                log.warning("exporter not started: %s: %s", type(exc).__name__, exc)
    return sinks
