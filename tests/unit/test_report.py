"""The run recorder's accounting on a scripted timeline (a fake clock, two ranks): step lines
wait for every rank's memory, a failure's discarded steps become lost work, and startup,
recovery and the goodput breakdown follow the definitions in observe/recovery_tracker.py and
observe/goodput.py. Then the report renders from those records, with no Ray."""

from __future__ import annotations

import struct
import types
from pathlib import Path

import pytest
from tensorboardX.proto import event_pb2

from raytrain_dt.observe import metrics as metrics_module
from raytrain_dt.observe.exporters import TensorBoardWriter
from raytrain_dt.observe.goodput import goodput
from raytrain_dt.observe.metrics import RunRecorder, read_jsonl
from raytrain_dt.observe.mfu import CPU_PEAK_FLOPS, peak_flops_per_accelerator
from raytrain_dt.observe.report import PLOTS, format_summary, render_report
from raytrain_dt.topology.layout import Layout
from raytrain_dt.topology.parallel_dims import ParallelDims

LAYOUT = Layout(
    ParallelDims(world_size=2, dp_shard=2), zero_stage=3, micro_batch=4, grad_accum=1
).as_dict()


class Clock:
    def __init__(self):
        self.now = 0.0

    def time(self) -> float:
        return self.now


def _step(rec: RunRecorder, clock: Clock, at: float, step: int, step_time: float) -> None:
    clock.now = at
    for rank in (1, 0):
        rec.rank_step(
            rank, {"step": step, "mem_allocated_bytes": 100 + rank, "mem_peak_bytes": 200 + rank}
        )
    rec.step_metrics(
        {
            "step": step,
            "loss": 5.0 - step + at / 100,
            "lr": 1e-3,
            "grad_norm": 1.0,
            "tokens_per_s": 1000.0,
            "step_time_s": step_time,
            "data_wait_s": 0.0,
            "consumed_samples": 8 * step,
            "mfu": 0.01,
        },
        2,
        "dp=2",
    )


def _formation(rec: RunRecorder, clock: Clock, at: float, resume_step: int, kind: str) -> None:
    clock.now = at
    rec.rewind(resume_step)
    rec.event(kind, new_layout=LAYOUT, resumed_step=resume_step, lost_steps=0)


def _tensorboard_losses(log_dir: Path) -> list[tuple[int, float]]:
    """train/loss by step as TensorBoard shows it: a session START at step s (purge_step)
    drops what earlier files logged for steps >= s."""
    losses: list[tuple[int, float]] = []
    for path in sorted(log_dir.iterdir()):
        data, i = path.read_bytes(), 0
        while i < len(data):  # TFRecord: length, its CRC, the Event, the Event's CRC
            (length,) = struct.unpack("<Q", data[i : i + 8])
            event = event_pb2.Event.FromString(data[i + 12 : i + 12 + length])
            i += 12 + length + 4
            if event.HasField("session_log"):
                losses = [(s, v) for s, v in losses if s < event.step]
            for value in event.summary.value:
                if value.tag == "train/loss":
                    losses.append((event.step, value.simple_value))
    return losses


@pytest.fixture
def clock(monkeypatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(metrics_module, "time", types.SimpleNamespace(time=fake.time))
    return fake


def test_recorder_accounts_failure_recovery_and_goodput(tmp_path, clock):
    rec = RunRecorder(tmp_path, 0, [TensorBoardWriter(tmp_path / "tb", 0)])  # session at t=0
    _formation(rec, clock, 1.0, 0, "start")
    # Rank 0's metrics arrive before rank 1's memory: the line waits for it.
    clock.now = 3.0
    rec.step_metrics(
        {
            "step": 1,
            "loss": 4.0,
            "lr": 1e-3,
            "grad_norm": 1.0,
            "tokens_per_s": 1000.0,
            "step_time_s": 1.0,
            "data_wait_s": 0.0,
            "consumed_samples": 8,
        },
        2,
        "dp=2",
    )
    rec.rank_step(0, {"step": 1, "mem_allocated_bytes": 100, "mem_peak_bytes": 200})
    assert read_jsonl(tmp_path / "metrics.jsonl") == []
    rec.rank_step(1, {"step": 1, "mem_allocated_bytes": 101, "mem_peak_bytes": 201})
    (line,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert line["mem_allocated_bytes"] == [100, 101] and line["mem_peak_bytes"] == [200, 201]
    assert line["time"] == 3.0  # when rank 0's metrics arrived, not when the line was written

    _step(rec, clock, 4.0, 2, 1.0)
    clock.now = 4.5
    rec.event("checkpoint", step=2, stall_s=0.2, write_s=0.3)
    _step(rec, clock, 5.0, 3, 1.0)
    clock.now = 7.0
    rec.event("failure", health="failed", step=3)
    _formation(rec, clock, 8.0, 2, "resize")  # resumes from step 2: step 3 is lost
    _step(rec, clock, 12.0, 3, 1.5)
    _step(rec, clock, 13.0, 4, 1.0)
    clock.now = 14.0
    rec.event("transition", old="running", new="finished")
    rec.close()

    events = read_jsonl(tmp_path / "events.jsonl")
    (startup,) = [e for e in events if e["event"] == "startup"]
    assert startup["startup_s"] == pytest.approx(3.0 - 1.0 - 0.0)  # first step's start - session
    (rewind,) = [e for e in events if e["event"] == "rewind"]
    assert rewind["dropped_steps"] == [3] and rewind["dropped_step_time_s"] == 1.0
    (recovery,) = [e for e in events if e["event"] == "recovery"]
    # Stopped when step 3 (later discarded) arrived at t=5; restarted at 12 - 1.5.
    assert recovery["recovery_s"] == pytest.approx(12.0 - 1.5 - 5.0)
    assert (
        recovery["cause"],
        recovery["lost_steps"],
        recovery["stopped_after_step"],
        recovery["resumed_step"],
    ) == ("failed", 1, 3, 2)
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    good = goodput(metrics, events)
    assert good.wall_s == 14.0
    assert good.productive_s == pytest.approx(1.0 + 1.0 + 1.5 + 1.0)
    assert (good.checkpoint_stall_s, good.lost_work_s) == (0.2, 1.0)
    assert good.other_s == pytest.approx(14.0 - 4.5 - 0.2 - 5.5 - 1.0 - 2.0)
    # TensorBoard shows the re-trained step 3, not the discarded one.
    tb = _tensorboard_losses(tmp_path / "tb")
    assert [s for s, _ in tb] == [1, 2, 3, 4]
    assert [v for _, v in tb] == pytest.approx([m["loss"] for m in metrics])

    # A new driver session on the same directory: the time it was away is recovery.
    clock.now = 20.0
    rec = RunRecorder(tmp_path, 2)  # resumes from the step-2 checkpoint; 3 and 4 are lost
    _formation(rec, clock, 21.0, 2, "start")
    _step(rec, clock, 30.0, 3, 1.0)
    rec.close()
    events = read_jsonl(tmp_path / "events.jsonl")
    recovery = [e for e in events if e["event"] == "recovery"][-1]
    assert recovery["cause"] == "driver restart" and recovery["lost_steps"] == 2
    assert recovery["recovery_s"] == pytest.approx(30.0 - 1.0 - 13.0)

    report = render_report(tmp_path)
    for name in PLOTS:
        assert report.plots[name].read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert report.summary["lost_steps"] == 3 and report.summary["recoveries"] == 2
    assert "lost steps        3" in format_summary(report.summary)


def test_host_memory_reaches_the_step_lines_and_the_model_built_event(tmp_path):
    """Per step, the host's peak RSS is the max over ranks; after a formation's build, the
    `model_built` event holds each rank's idle and peak RSS and their max."""
    rec = RunRecorder(tmp_path, 0)
    rec.model_built(
        [
            {"model_build_s": 1.5, "host_rss_idle_bytes": 400, "host_rss_peak_bytes": 900},
            {"model_build_s": 2.0, "host_rss_idle_bytes": 410, "host_rss_peak_bytes": 950},
        ]
    )
    for rank, host in ((0, 1000), (1, 1200)):
        rec.rank_step(
            rank,
            {"step": 1, "mem_allocated_bytes": 5, "mem_peak_bytes": 6, "host_rss_peak_bytes": host},
        )
    rec.step_metrics({"step": 1, "loss": 4.0, "step_time_s": 1.0}, 2, "dp=2")
    rec.close()
    (built,) = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "model_built"]
    assert built["host_rss_peak_bytes"] == 950 and built["model_build_s"] == 2.0
    assert built["rank_host_rss_idle_bytes"] == [400, 410]
    assert built["rank_host_rss_peak_bytes"] == [900, 950]
    (line,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert line["host_rss_peak_bytes"] == 1200


def test_peak_flops_lookup():
    assert peak_flops_per_accelerator("cpu", None) == CPU_PEAK_FLOPS
    assert peak_flops_per_accelerator("NVIDIA H100 PCIe", None) == 756e12
    assert peak_flops_per_accelerator("NVIDIA H100 80GB HBM3", None) == 989e12
    assert peak_flops_per_accelerator("NVIDIA A100-SXM4-80GB", None) == 312e12
    assert peak_flops_per_accelerator("NVIDIA A100-SXM4-80GB", 100.0) == 100e12


def test_real_global_batch_reaches_metrics_and_its_plot(tmp_path):
    """Each step line holds the batch the step trained; the report plots it per step."""
    import matplotlib.image

    rec = RunRecorder(tmp_path, 0)
    rec.event("start", new_layout=LAYOUT, resumed_step=0, lost_steps=0)
    for step, batch in ((1, 8), (2, 8), (3, 6), (4, 6)):
        for rank in (0, 1):
            rec.rank_step(rank, {"step": step, "mem_allocated_bytes": 5, "mem_peak_bytes": 6})
        rec.step_metrics(
            {
                "step": step,
                "loss": 4.0,
                "tokens_per_s": 1.0,
                "step_time_s": 1.0,
                "global_batch": batch,
            },
            2,
            "dp=2",
        )
    rec.close()
    assert [m["global_batch"] for m in read_jsonl(tmp_path / "metrics.jsonl")] == [8, 8, 6, 6]
    report = render_report(tmp_path)
    image = matplotlib.image.imread(report.plots["global_batch"])
    assert image.shape[0] > 100 and image.shape[1] > 100
    assert 'src="report/global_batch.png"' in report.html.read_text()
