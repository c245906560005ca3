"""Benchmark: the input pipeline. How long ranks wait for data, as a share of step time, and
how fast the Ray Data pipeline delivers when drained alone against how fast training eats.

(a) `raytrain-dt train` on the overhead workload (~100 ms steps on a quiet
    CPU): rank 0's `data_wait_s` (time to pull the step's micro-batches) over `step_time_s`,
    summed over the steady-state steps, median over repeats.
(b) The same rank's pipeline (`data.input_pipeline.iterate_micro_batches`, same DataSlice, same
    prefetch) drained with no training in an embedded Ray instance: samples/s after the first
    batch, median over repeats, against the consumption rate of that rank in (a).
Writes bench/results/input.json. Run: python bench/bench_input.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import common
from bench_overhead import GLOBAL_BATCH, PINS, PRESET, SEQ_LEN, workload

TARGET_SHARE = 0.02
DRAIN_ROWS = 16384  # several Ray Data blocks, so the rate is the streaming rate


def measure_wait(steps: int, warmup: int, run_dir: Path) -> tuple[float, float]:
    """(share of step time spent waiting for data, median step time) of one run."""
    common.run_train(run_dir, workload(steps))
    metrics = common.read_jsonl(run_dir / "metrics.jsonl")[warmup:]
    share = sum(m["data_wait_s"] for m in metrics) / sum(m["step_time_s"] for m in metrics)
    return share, statistics.median(m["step_time_s"] for m in metrics)


def drain_rate(repeats: int) -> list[float]:
    """Samples/s of DP rank 0's pipeline drained alone, one value per repeat."""
    import ray

    from raytrain_dt.config import load_config
    from raytrain_dt.data.input_pipeline import DataPlacement, DataSlice, iterate_micro_batches
    from raytrain_dt.data.source import TokenDataset

    cfg = load_config(common.RECIPE, common.workload_overrides(PRESET, SEQ_LEN, 1, GLOBAL_BATCH))
    dataset = TokenDataset.open(cfg.data.path, SEQ_LEN)
    dp = PINS["parallel.dp_shard"]
    data = DataSlice(
        dataset=dataset,
        shuffle_seed=cfg.data.shuffle_seed,
        consumed_samples=0,
        num_steps=DRAIN_ROWS * dp // GLOBAL_BATCH,
        global_batch=GLOBAL_BATCH,
        dp=dp,
        dp_rank=0,
        micro_batch=PINS["trainer.micro_batch"],
    )
    rates = []
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        for _ in range(repeats):
            batches = iterate_micro_batches(
                data, cfg.data.prefetch_batches, DataPlacement(cfg.cluster.data_cpus_per_rank)
            )
            rows = len(next(batches)["sample_id"])  # start-up is not throughput
            started, drained = time.perf_counter(), 0
            for batch in batches:
                drained += len(batch["sample_id"])
            rates.append(drained / (time.perf_counter() - started))
            assert rows + drained == data.num_rows, "the pipeline lost or repeated rows"
    finally:
        ray.shutdown()
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    run_dir = common.SCRATCH / "input"
    waits = [measure_wait(args.steps, args.warmup, run_dir) for _ in range(args.repeats)]
    share = statistics.median(s for s, _ in waits)
    step_s = statistics.median(t for _, t in waits)
    consumption = GLOBAL_BATCH / PINS["parallel.dp_shard"] / step_s  # samples/s per DP rank
    rates = drain_rate(args.repeats)
    rate = statistics.median(rates)
    ok = share < TARGET_SHARE
    cases = [
        {
            "measure": "data wait / step time (rank 0)",
            "value": f"{share:.2%}",
            "per_repeat": [f"{s:.2%}" for s, _ in waits],
            "status": "PASS" if ok else "FAIL",
        },
        {
            "measure": "median step time (s)",
            "value": round(step_s, 4),
            "per_repeat": [round(t, 4) for _, t in waits],
        },
        {"measure": "consumption per DP rank (samples/s)", "value": round(consumption, 1)},
        {
            "measure": "pipeline drained alone, one DP rank (samples/s)",
            "value": round(rate, 1),
            "per_repeat": [round(r, 1) for r in rates],
        },
        {"measure": "pipeline rate / consumption", "value": round(rate / consumption, 1)},
    ]
    common.write_result(
        "input",
        "Input pipeline: data wait and throughput",
        "python bench/bench_input.py",
        f"data wait < {TARGET_SHARE:.0%} of step time",
        cases,
        notes=f"preset {PRESET}, seq_len {SEQ_LEN}, global batch {GLOBAL_BATCH}, 2 ranks; "
        f"{args.steps} steps, first {args.warmup} dropped; drain: {DRAIN_ROWS} rows of rank 0 "
        f"with prefetch as configured; 1-min load average at the end {common.load_average():.1f}",
    )
    print(
        f"input: data wait {share:.2%} of step time (target < {TARGET_SHARE:.0%}); pipeline "
        f"{rate:.0f} samples/s alone vs {consumption:.1f} consumed ({rate / consumption:.0f}x)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
