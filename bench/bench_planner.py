"""Benchmark: wall time of `planner.plan` for model/cluster pairs up to 405B on 8192 GPUs.

Pure Python, no Ray or torch. Prints one line per case (median over repeats) and writes
bench/results/planner.json. Run: python bench/bench_planner.py [--repeats N]
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
from raytrain_dt.topology.layout import Topology
from raytrain_dt.topology.memory import shape_for_params
from raytrain_dt.topology.planner import plan

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
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "title": "Planner speed",
        "command": "python bench/bench_planner.py",
        "target": "405B on 1024 nodes x 8 accelerators plans in under 1 s",
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cases": results,
    }
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
