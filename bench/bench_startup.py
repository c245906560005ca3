"""Benchmark: start-up of `raytrain-dt train`, from the command to the first completed step.

Runs the tiny model for a few steps on an embedded Ray instance (2 ranks), `--repeats` times,
each in a fresh process, and splits the time with what the run directory records:
- imports and checks: command start to the `connected` event, less Ray's start;
- Ray start: `connected.ray_start_s` (ray.init of the embedded instance);
- actor start: the `start` event's `form_s` (placement group, actors created, where they are);
- process-group init, model build, data start: the set-up timings of the slowest rank
  (`start.rank_setup`; ranks set up in parallel). "data start" is what set-up spent on the
  input (`data_wait_s` where set-up overlaps opening the input with the rest, else
  `data_start_s`); the slowest rank's `data_start_s` is reported beside it as
  `data_start_concurrent`. Input start-up that a rank defers into training lands in the
  first step;
- first step: rank 0's `step_time_s` of step 1;
- other: the rest (rank specs, the start call, the coordinator's poll interval).
Medians over repeats. Writes bench/results/startup.json; exits 1 when a part comes out negative
(counted twice: the split no longer adds up). Run: python bench/bench_startup.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import common

PARTS = (
    "imports_and_checks_s",
    "ray_start_s",
    "actor_start_s",
    "process_group_s",
    "model_build_s",
    "data_start_s",
    "first_step_s",
    "other_s",
)
# A rank's set-up on its critical path (`data_wait_s`: only where input opens alongside the rest).
SETUP_PARTS = ("process_group_s", "model_build_s", "data_wait_s")


def split(launched: float, run_dir: Path) -> dict:
    events = {e["event"]: e for e in reversed(common.read_jsonl(run_dir / "events.jsonl"))}
    first = common.read_jsonl(run_dir / "metrics.jsonl")[0]
    connected, start = events["connected"], events["start"]
    # Ranks set up in parallel: the parts of the slowest one are what the run waited for.
    slowest = max(start["rank_setup"], key=lambda r: sum(r.get(k, 0.0) for k in SETUP_PARTS))
    parts = {
        "imports_and_checks_s": connected["time"] - launched - connected["ray_start_s"],
        "ray_start_s": connected["ray_start_s"],
        "actor_start_s": start["form_s"],
        "process_group_s": slowest["process_group_s"],
        "model_build_s": slowest["model_build_s"],
        "data_start_s": slowest.get("data_wait_s", slowest["data_start_s"]),
        "first_step_s": first["step_time_s"],
    }
    concurrent_data_start = max(r["data_start_s"] for r in start["rank_setup"])
    total = first["time"] - launched
    parts["other_s"] = total - sum(parts.values())
    parts["total_s"] = total
    parts["data_start_concurrent_s"] = concurrent_data_start
    return parts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    overrides = common.workload_overrides("tiny", 128, 3, 8)
    run_dir = common.SCRATCH / "startup"
    samples = []
    for _ in range(args.repeats):
        common.dataset_path(128)  # prepared once, outside the timed part
        launched = time.time()
        common.run_train(run_dir, overrides)
        samples.append(split(launched, run_dir))
    cases = []
    for part in (*PARTS, "total_s", "data_start_concurrent_s"):
        values = [s[part] for s in samples]
        cases.append(
            {
                "part": part.removesuffix("_s"),
                "median_s": round(statistics.median(values), 3),
                "per_repeat_s": [round(v, 3) for v in values],
                "status": "PASS" if min(values) >= 0 else "FAIL",
            }
        )
    total = statistics.median(s["total_s"] for s in samples)
    for case in cases[: len(PARTS) + 1]:  # the concurrent data start is no share of it
        case["share"] = f"{case['median_s'] / total:.0%}"
    common.write_result(
        "startup",
        "Start-up: command to first completed step",
        "python bench/bench_startup.py",
        "each part named and measured, none negative: the parts account for the whole, none "
        "counted twice (no numeric target in the issue)",
        cases,
        notes=f"tiny preset, 2 ranks on embedded Ray, {args.repeats} repeats, fresh process each; "
        f"1-min load average at the end {common.load_average():.1f}",
    )
    medians = {c["part"]: c["median_s"] for c in cases}
    print("startup: " + ", ".join(f"{k} {v:.2f}s" for k, v in medians.items()))
    # A negative part (`other` above all) means a part was counted twice, or one measured
    # from the wrong event: the split no longer adds up.
    negative = [c["part"] for c in cases if c["status"] == "FAIL"]
    print(
        f"{'FAIL' if negative else 'PASS'}: every part measured"
        + (f"; negative: {negative}" if negative else "")
    )
    return 1 if negative else 0


if __name__ == "__main__":
    sys.exit(main())
