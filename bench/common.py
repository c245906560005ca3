"""What the run-based benchmarks share: the workload, launching `raytrain-dt train`, reading
its run directory, steady-state medians and writing a result record for `bench/render.py`.

The workload is one fixed recipe (conf/tiny.yaml plus overrides) so that our coordinator, the
plain torchrun script and Ray Train's TorchTrainer all train the same model on the same batches.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
RECIPE = str(REPO / "conf" / "tiny.yaml")
# Scratch space for run directories and datasets (git-ignored).
SCRATCH = REPO / "runs" / "bench"


def dataset_path(seq_len: int) -> str:
    """The stdlib corpus tokenized at `seq_len`, prepared once and reused."""
    path = REPO / "data" / f"stdlib_tokens_{seq_len}"
    if not path.exists():
        from raytrain_dt.data.prepare import prepare_dataset

        prepare_dataset(path, None, seq_len)
    return str(path)


def workload_overrides(
    preset: str, seq_len: int, steps: int, global_batch: int, layout: dict | None = None
) -> list[str]:
    """Dotlist for one benchmark workload: no checkpoints, short warmup, layout pinned if given."""
    overrides = [
        f"model.preset={preset}",
        f"data.seq_len={seq_len}",
        f"data.path={dataset_path(seq_len)}",
        f"trainer.steps={steps}",
        f"trainer.global_batch={global_batch}",
        f"trainer.warmup_steps={min(2, steps)}",
        "checkpoint.every_steps=0",
        "resume=false",
        # A loaded shared machine can stall a first step past the default 60 s; a benchmark
        # must not mistake that for a hang and restart.
        "elastic.hang_timeout_s=600",
    ]
    for key, value in (layout or {}).items():
        overrides.append(f"{key}={value}")
    return overrides


def run_train(
    run_dir: Path, overrides: list[str], recipe: str = RECIPE, timeout_s: float = 900.0
) -> float:
    """`raytrain-dt train` in a fresh process (embedded Ray); returns its wall time in seconds."""
    import shutil

    shutil.rmtree(run_dir, ignore_errors=True)
    command = [
        sys.executable,
        "-m",
        "raytrain_dt.cli",
        "train",
        recipe,
        f"run.dir={run_dir}",
        *overrides,
    ]
    started = time.perf_counter()
    proc = subprocess.run(
        command,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, "RAY_DEDUP_LOGS": "0"},
    )
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"raytrain-dt train failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return wall


def read_jsonl(path: Path) -> list[dict]:
    from raytrain_dt.observe.metrics import read_jsonl as read

    return read(path)


def steady_median(values: list[float], warmup: int) -> float:
    """Median after dropping the first `warmup` values (compilation, allocator, prefetch fill)."""
    tail = values[warmup:] or values
    return statistics.median(tail)


def steady_period(step_ends: list[float], warmup: int) -> float:
    """Seconds per step in steady state: the least-squares slope of step end time against
    step number after `warmup` steps. It holds everything between steps (reporting,
    collectives outside the timed step), and averages out coarse timestamps such as the
    coordinator's 0.1 s polls."""
    import numpy as np

    ends = np.asarray(step_ends[warmup:], dtype=float)
    return float(np.polyfit(np.arange(len(ends)), ends - ends[0], 1)[0])


def write_result(
    name: str, title: str, command: str, target: str, cases: list[dict], notes: str = "", **extra
) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    record = {
        "title": title,
        "command": command,
        "target": target,
        "notes": notes,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cases": cases,
        **extra,
    }
    path = RESULTS / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(path)
    return path


def load_average() -> float:
    return os.getloadavg()[0]
