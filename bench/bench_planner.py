"""Benchmark: wall time of `planner.plan` for model/cluster pairs up to 405B on 8192 GPUs, and
the step-time model against published GPU runs.

Pure Python, no Ray or torch. Prints one line per case (median over repeats), then one line per
published run (`topology/published_runs.py`: source, configuration, published figure,
prediction, ratio; PASS within +-20%), and writes bench/results/planner.json. Exits non-zero if
planning 405B on 8192 GPUs takes 1 s or more, or a published row misses its target.
Run: python bench/bench_planner.py [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

from raytrain_dt.models.presets import PRESETS
from raytrain_dt.topology.calibration import CALIBRATION
from raytrain_dt.topology.layout import Topology
from raytrain_dt.topology.memory import shape_for_params
from raytrain_dt.topology.planner import plan
from raytrain_dt.topology.published_runs import (
    FREE_PICK_SLACK,
    PUBLISHED_RUNS,
    SOURCES_CHECKED,
    TOLERANCE,
)

# (label, shape, nodes, accelerators per node, global batch, seq len)
CASES = [
    ("tiny 1x2", PRESETS["tiny"], 1, 2, 8, 128),
    ("llama-1b 1x8", PRESETS["llama-1b"], 1, 8, 256, 4096),
    ("llama-7b 1x8", PRESETS["llama-7b"], 1, 8, 256, 4096),
    ("llama-7b 4x8", PRESETS["llama-7b"], 4, 8, 512, 4096),
    ("7.5e9-params 8x8", shape_for_params(7.5e9), 8, 8, 512, 4096),
    ("llama-70b 8x8", PRESETS["llama-70b"], 8, 8, 1024, 4096),
    ("llama-70b 3x8 (fallback world)", PRESETS["llama-70b"], 3, 8, 1024, 4096),
    ("llama-405b 16x8", PRESETS["llama-405b"], 16, 8, 1024, 4096),
    ("llama-405b 1024x8", PRESETS["llama-405b"], 1024, 8, 2048, 8192),
    # Context parallelism is searched only for long sequences; expert parallelism for MoE.
    ("8e9-params 8x8 at 131072 tokens", shape_for_params(8e9), 8, 8, 32, 131072),
    ("mixtral-8x7b 8x8", PRESETS["mixtral-8x7b"], 8, 8, 1024, 4096),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "planner.json"))
    args = parser.parse_args()
    results = []
    for label, shape, nodes, per_node, gb, seq in CASES:
        topo = Topology(nodes, per_node)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            p = plan(shape, topo, global_batch=gb, seq_len=seq)
            times.append(time.perf_counter() - start)
        median_ms = statistics.median(times) * 1e3
        row = {
            "case": label,
            "accelerators": topo.num_accelerators,
            "median_ms": round(median_ms, 3),
            "min_ms": round(min(times) * 1e3, 3),
            "max_ms": round(max(times) * 1e3, 3),
            "repeats": args.repeats,
            "fitting_layouts": p.fitting_layouts,
            "layout": p.best.layout.describe(),
            "step_time_s": round(p.best.step_time.total_s, 3),
            "memory_gb": round(p.best.memory.total / 1e9, 2),
        }
        results.append(row)
        print(
            f"{label:<32} {median_ms:8.2f} ms median ({row['fitting_layouts']:>4} fitting)  "
            f"{row['layout']}  {row['memory_gb']} GB  {row['step_time_s']} s/step"
        )
    calibration = calibration_rows()
    free_picks = free_pick_rows()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "title": "Planner speed",
        "command": "python bench/bench_planner.py",
        "target": "405B on 1024 nodes x 8 accelerators plans in under 1 s",
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cases": results,
        "tables": [
            {
                "title": f"Step-time model against published runs (calibration {CALIBRATION}; "
                f"target: every row within +-{TOLERANCE:.0%})",
                "cases": calibration,
            },
            {
                "title": "The planner's free pick against each published layout (target: no "
                f"slower, or within {FREE_PICK_SLACK:.0%}; where it differs, why)",
                "cases": free_picks,
            },
            {
                "title": "Sources checked (each published figure read back from its source)",
                "cases": [
                    {"source": source, "where read": where, "checked": what}
                    for source, (where, what) in SOURCES_CHECKED.items()
                ],
            },
        ],
    }
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")
    largest = next(r for r in results if r["case"] == "llama-405b 1024x8")
    fast = largest["median_ms"] < 1000
    missed = [r["configuration"] for r in calibration if r["result"] != "PASS"]
    print(f"{'PASS' if fast else 'FAIL'}: 405B on 8192 GPUs plans in {largest['median_ms']} ms")
    print(
        f"{'FAIL' if missed else 'PASS'}: {len(calibration) - len(missed)}/{len(calibration)} "
        f"published rows within +-{TOLERANCE:.0%}" + (f" (missed: {missed})" if missed else "")
    )
    slower = [r["configuration"] for r in free_picks if r["result"] != "PASS"]
    print(
        f"{'FAIL' if slower else 'PASS'}: {len(free_picks) - len(slower)}/{len(free_picks)} free "
        f"picks no slower than the published layout (+{FREE_PICK_SLACK:.0%})"
        + (f" (slower: {slower})" if slower else "")
    )
    return 0 if fast and not missed and not slower else 1


def free_pick_rows() -> list[dict]:
    rows = []
    for run in PUBLISHED_RUNS:
        ratio, why = run.free_vs_published()
        row = {
            "source": run.source,
            "configuration": run.label,
            "published layout": run.layout().describe(),
            "published layout s/step": round(run.predicted().total_s, 2),
            "free pick / published": round(ratio, 3),
            "result": "PASS" if ratio <= 1 + FREE_PICK_SLACK else "FAIL",
            "why": why,
        }
        rows.append(row)
        print(f"{row['result']} {ratio:6.3f}  {run.label}: {why}")
    return rows


def calibration_rows() -> list[dict]:
    rows = []
    for run in PUBLISHED_RUNS:
        lay, t = run.layout(), run.predicted()
        ratio = run.ratio()
        passed = abs(ratio - 1.0) <= TOLERANCE
        config = (
            f"{run.label}: {run.gpus} x {run.gpu.name}, tp={run.tp} pp={run.pp} "
            + (f"cp={run.cp} " if run.cp > 1 else "")
            + f"dp={lay.dims.dp}"
            + (f" v={run.virtual_stages}" if run.virtual_stages > 1 else "")
            + f", {run.global_batch} x {run.seq_len} tokens, micro-batch {run.micro_batch}"
            + (", full AC" if run.activation_checkpointing else "")
        )
        row = {
            "source": run.source,
            "configuration": config,
            "published": f"{run.figure:g} {run.unit}",
            "predicted": f"{run.predicted_figure():.1f}",
            "ratio": round(ratio, 3),
            "predicted_step_s": round(t.total_s, 2),
            "compute/comm/bubble s": f"{t.compute_s:.1f}/"
            f"{t.dp_comm_s + t.tp_comm_s + t.cp_comm_s + t.ep_comm_s + t.pp_comm_s:.1f}/"
            f"{t.bubble_s:.1f}",
            "result": "PASS" if passed else "FAIL",
            "assumed / why": run.assumed,
        }
        rows.append(row)
        print(f"{row['result']} {ratio:6.3f}  {config}  ({run.figure:g} {run.unit})")
    return rows


if __name__ == "__main__":
    sys.exit(main())
