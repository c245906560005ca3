"""Checks of a run's report, metrics and events against each other, shared by the tests that
produce a run directory (the elastic runs, the status test), and of a commit record against the
files it describes.

Every number is recomputed here from the raw records by another route than the report's
(the coordinator's own lost-step counts, the formation timings in the resize events, the
world sizes of the metric lines), so a wrong definition or a wrong sum fails.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import re
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest

from raytrain_dt.control.run_setup import model_shape
from raytrain_dt.observe.metrics import read_jsonl
from raytrain_dt.observe.mfu import CPU_PEAK_FLOPS

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Clock tolerance between the driver's wall clock and durations measured with perf_counter.
TOL_S = 0.05


def check_manifest(step_uri: str) -> dict:
    """The commit record lists exactly the files of the step directory (every rank reported
    all it wrote), each with the size and SHA-256 stored; returns the record."""
    from raytrain_dt.checkpoint.digests import digest_tree
    from raytrain_dt.checkpoint.storage import Location

    record = Location.parse(step_uri).child("commit.json").read_json()
    stored = digest_tree(step_uri)
    del stored["commit.json"]
    assert record["files"] == stored
    return record


@contextlib.contextmanager
def file_reads_below(root_uri: str) -> Iterator[list[str]]:
    """The files below `root_uri` this process opens for reading meanwhile, through fsspec
    (what `Location` uses, local and S3 alike) or `open()`, relative to the root."""
    import fsspec

    from raytrain_dt.checkpoint.storage import Location

    root = Location.parse(root_uri).path.rstrip("/") + "/"
    reads: list[str] = []
    fsspec_open, plain_open = fsspec.AbstractFileSystem.open, builtins.open

    def note(path, mode) -> None:
        path = str(path).split("://", 1)[-1]
        if "r" in str(mode) and path.startswith(root):
            reads.append(path.removeprefix(root))

    def spy_fsspec(self, path, mode="rb", *args, **kwargs):
        note(path, mode)
        return fsspec_open(self, path, mode, *args, **kwargs)

    def spy_open(file, mode="r", *args, **kwargs):
        note(file, mode)
        return plain_open(file, mode, *args, **kwargs)

    with (
        mock.patch.object(fsspec.AbstractFileSystem, "open", spy_fsspec),
        mock.patch.object(builtins, "open", spy_open),
        mock.patch.object(io, "open", spy_open),
    ):
        yield reads


def check_step_metrics(cfg, run_dir: str | Path) -> list[dict]:
    """MFU from the model's FLOPs and the CPU peak; memory for every rank of every step; the
    real global batch of every step: the configured one, or within trainer.batch_tolerance."""
    metrics = read_jsonl(Path(run_dir) / "metrics.jsonl")
    flops_per_token = model_shape(cfg).flops_per_token(cfg.data.seq_len)
    batch, tolerance = cfg.trainer.global_batch, cfg.trainer.batch_tolerance
    for m in metrics:
        assert (1 - tolerance) * batch <= m["global_batch"] <= batch, m
        expected = flops_per_token * m["tokens_per_s"] / (m["world_size"] * CPU_PEAK_FLOPS)
        assert m["mfu"] == pytest.approx(expected, rel=1e-9)
        assert len(m["mem_allocated_bytes"]) == len(m["mem_peak_bytes"]) == m["world_size"]
        for now, peak in zip(m["mem_allocated_bytes"], m["mem_peak_bytes"]):
            assert 0 < now <= peak
    return metrics


def _number(text: str, label: str) -> float:
    (line,) = [ln for ln in text.splitlines() if ln.startswith(label + "  ")]
    return float(re.search(r"-?\d+(\.\d+)?", line[len(label) :]).group())


def check_report(cfg, run_dir: str | Path) -> dict:
    """Render the report; check its plots and every number of its summary."""
    import matplotlib.image

    from raytrain_dt.observe.report import PLOTS, format_summary, render_report

    run_dir = Path(run_dir)
    report = render_report(run_dir)
    page = report.html.read_text()
    for name in PLOTS:
        path = report.plots[name]
        assert path.read_bytes().startswith(PNG_SIGNATURE), path
        height, width = matplotlib.image.imread(path).shape[:2]  # decodes the whole file
        assert height > 100 and width > 100
        assert f'src="report/{path.name}"' in page

    metrics = check_step_metrics(cfg, run_dir)
    events = read_jsonl(run_dir / "events.jsonl")

    def of(kind: str) -> list[dict]:
        return [e for e in events if e["event"] == kind]

    line = {m["step"]: m for m in metrics}
    stalls = {e["step"]: e["stall_s"] for e in of("checkpoint")}
    formations = of("start") + of("resize")
    # Each recovery: it ends where its first step began, it contains the formation, and it
    # starts where the last step before it ended (kept), or between the checkpoint it resumed
    # from and the failure (when the steps after that checkpoint were discarded).
    for r in of("recovery"):
        if any(r["step"] in e["dropped_steps"] for e in of("rewind") if e["time"] > r["time"]):
            continue  # a later fault discarded its first step: the metrics hold the retrained one
        started = line[r["step"]]["time"] - line[r["step"]]["step_time_s"]
        stopped = started - r["recovery_s"]
        form = max((e for e in formations if e["time"] < started + 1.0), key=lambda e: e["time"])
        formed_at = form["time"] - form["setup_s"]
        assert stopped <= formed_at - form["form_s"] + TOL_S and formed_at <= started + TOL_S
        assert r["lost_steps"] == form["lost_steps"]  # the coordinator's own count
        assert (r["lost_work_s"] > 0) == (r["lost_steps"] > 0)
        if r["lost_steps"] == 0:
            last = r["stopped_after_step"]
            assert stopped == pytest.approx(line[last]["time"] + stalls.get(last, 0.0), abs=1e-6)
        else:
            failure = max(
                (e for e in of("failure") if e["time"] < started), key=lambda e: e["time"]
            )
            # Resumed from step 0 (no checkpoint committed yet): the run's start bounds it.
            resumed = r["resumed_step"]
            since = line[resumed]["time"] if resumed else of("session")[0]["time"]
            assert since <= stopped <= failure["time"]

    sessions = of("session")
    wall = max(x["time"] for x in events + metrics) - sessions[0]["time"]
    sizes = [m["world_size"] for m in metrics]
    expected = {
        "steps": cfg.trainer.steps,
        "final_loss": metrics[-1]["loss"],
        "wall_s": wall,
        "productive_s": sum(m["step_time_s"] for m in metrics),
        "checkpoint_stall_s": sum(stalls.values()),
        "recovery_s": sum(r["recovery_s"] for r in of("recovery")),
        "lost_work_s": sum(r["lost_work_s"] for r in of("recovery")),
        "startup_s": of("startup")[0]["startup_s"],
        "failures": len(of("failure")),
        "preemptions": len(of("preemption_notice")),
        "resizes": len(of("resize")),
        "recoveries": len(of("resize")),  # every resize here followed trained steps
        "checkpoints": len(stalls),
        "lost_steps": sum(e["lost_steps"] for e in formations),
        "mean_tokens_per_s": sum(m["tokens_per_s"] for m in metrics) / len(metrics),
        "peak_memory_bytes": max(b for m in metrics for b in m["mem_peak_bytes"]),
        "world_sizes": [s for i, s in enumerate(sizes) if i == 0 or sizes[i - 1] != s],
    }
    summary = report.summary
    for key, value in expected.items():
        assert summary[key] == pytest.approx(value, rel=1e-9, abs=1e-9), key
    parts = ("productive_s", "checkpoint_stall_s", "recovery_s", "lost_work_s", "startup_s")
    assert all(summary[p] >= 0 for p in parts)
    assert summary["other_s"] == pytest.approx(wall - sum(summary[p] for p in parts), abs=1e-9)
    assert summary["other_s"] > -TOL_S
    assert summary["goodput"] == pytest.approx(expected["productive_s"] / wall, rel=1e-9)

    # The terminal summary prints the same numbers, rounded.
    text = format_summary(summary)
    printed = {
        "steps": ("steps", 1, 0),
        "final loss": ("final_loss", 1, 4),
        "wall time": ("wall_s", 1, 2),
        "productive": ("productive_s", 1, 2),
        "checkpoint stall": ("checkpoint_stall_s", 1, 2),
        "recovery": ("recovery_s", 1, 2),
        "lost work": ("lost_work_s", 1, 2),
        "startup": ("startup_s", 1, 2),
        "failures": ("failures", 1, 0),
        "preemptions": ("preemptions", 1, 0),
        "resizes": ("resizes", 1, 0),
        "lost steps": ("lost_steps", 1, 0),
        "checkpoints": ("checkpoints", 1, 0),
        "mean tokens/s": ("mean_tokens_per_s", 1, 1),
        "goodput": ("goodput", 100, 1),
        "peak memory": ("peak_memory_bytes", 2**-30, 2),
    }
    for label, (key, scale, decimals) in printed.items():
        value = expected.get(key, summary[key]) * scale
        assert _number(text, label) == pytest.approx(value, abs=0.51 * 10**-decimals), label
    assert _number(text, "world sizes") == expected["world_sizes"][0]
    return summary
