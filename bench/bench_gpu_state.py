"""Benchmark: what keeping state costs the train step on one GPU: in-memory copies of every
step (issue 19: <= 3%) and a checkpoint every N steps, async (issue 21: <= 2%, at an N where a
synchronous save is >= 10% of its window).

Every case is `raytrain-dt train` on one GPU (cluster.device=cuda, bf16, FSDP2 on one rank,
embedded Ray, Ray Data input) with the same model, batches and seed; its cost is read from the
run's steady seconds per step (the slope of step end times in metrics.jsonl, so it holds
everything the loop does between steps, saves and their waits included):
- `none`: no copies, no checkpoints (the reference);
- `copies`: `checkpoint.memory_every_steps=1` (one rank has no peer: the copy is staged to
  pinned host memory and kept, the device-to-host part a peer send starts from);
- `sync N`, `async N`: a checkpoint every N steps, written synchronously or in the background.
N is calibrated: `sync 10` gives the save's time, and N is the largest count of steps with a
synchronous save still >= 10% of its window (N steps plus the save), at most 50; both
checkpoint cases then run at that N, over the same number of windows.

The model (~270M parameters, 3.2 GB of fp32 parameters and AdamW moments) and 32K tokens per
step are sized so that a copy of the state (about 65 ms at 50 GB/s) is about half a step
(0.13 s at 40% MFU on an H100/H200): a copy that does not overlap the step shows as a
one-and-a-half-times step. At scale each rank holds 1/dp_shard of the state for the same tokens,
so the copy's share only falls.

Where torch sees no CUDA device it measures nothing and exits 0 (not a miss).
Writes bench/results/gpu_state.json; exits 1 when a target is missed. About 8 minutes on an
H200 with the defaults (each run pays Ray's start and the model's build, about 25 s).
Run: python bench/bench_gpu_state.py [--cases none,copies,checkpoint] [--steps N] [--repeats R]
`--smoke`: the same runs on the CPU with a tiny model and few steps, printed, not written:
checks that the script works; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import common

COPIES_TARGET = 1.03
CHECKPOINT_TARGET = 1.02
SYNC_SHARE_MIN = 0.10
SEQ_LEN, GLOBAL_BATCH, MICRO_BATCH = 2048, 16, 8
SHAPE = [
    "model.dim=1024",
    "model.n_layers=16",
    "model.n_heads=16",
    "model.n_kv_heads=16",
    "model.ffn_hidden=2816",
]
PINS = {
    "cluster.device": "cuda",
    "cluster.num_ranks": 1,
    "engine.precision": "bf16",
    "trainer.micro_batch": MICRO_BATCH,
    "trainer.grad_accum": GLOBAL_BATCH // MICRO_BATCH,
}
WARMUP = 8
CALIBRATION_EVERY = 10
WINDOWS = 3


SMOKE = {"seq_len": 64, "pins": {**PINS, "cluster.device": "cpu", "engine.precision": "fp32"}}


def period(name: str, steps: int, extra: list[str], smoke: bool = False) -> float:
    """Steady seconds per step of one run (the first WARMUP steps dropped)."""
    seq_len, pins = (SMOKE["seq_len"], SMOKE["pins"]) if smoke else (SEQ_LEN, PINS)
    overrides = common.workload_overrides("small", seq_len, steps, GLOBAL_BATCH, pins)
    run_dir = common.SCRATCH / f"gpu_state_{name}"
    common.run_train(run_dir, [*overrides, *([] if smoke else SHAPE), *extra])
    ends = [m["time"] for m in common.read_jsonl(run_dir / "metrics.jsonl")]
    seconds = common.steady_period(ends, WARMUP)
    print(f"{name}: {seconds * 1e3:.1f} ms/step over {steps} steps", flush=True)
    return seconds


def checkpointing(every: int, use_async: bool) -> list[str]:
    return [
        f"checkpoint.every_steps={every}",
        f"checkpoint.async_save={str(use_async).lower()}",
        "checkpoint.memory_every_steps=0",
        "checkpoint.keep_last=1",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="none,copies,checkpoint")
    parser.add_argument("--steps", type=int, default=40, help="steps of the none/copies runs")
    parser.add_argument("--repeats", type=int, default=2, help="none/copies pairs")
    parser.add_argument("--smoke", action="store_true", help="check the script works (see top)")
    args = parser.parse_args()
    import functools

    import torch

    if not torch.cuda.is_available() and not args.smoke:
        print("no CUDA device: nothing measured")
        return 0
    if args.smoke:
        args.steps, args.repeats = WARMUP + 4, 1
    run = functools.partial(period, smoke=args.smoke)
    cases = set(args.cases.split(","))
    # The reference and the copies in turn, `--repeats` times: one run's steady step time
    # differs from the next one's by a few percent here (184.6-197.3 ms for the same run on an
    # H200), as much as the copies' target, so ratios are medians of back-to-back pairs.
    periods: dict[str, list[float]] = {"none": [], "copies": []}
    for repeat in range(args.repeats):
        periods["none"].append(
            run(f"none_{repeat}", args.steps, ["checkpoint.memory_every_steps=0"])
        )
        if "copies" in cases:
            extra = ["checkpoint.memory_every_steps=1"]
            periods["copies"].append(run(f"copies_{repeat}", args.steps, extra))
    base = statistics.median(periods["none"])
    rows, missed = [{"case": "none", "s_per_step": round(base, 4), "runs_s": periods["none"]}], []
    if "copies" in cases:
        ratio = statistics.median(c / n for c, n in zip(periods["copies"], periods["none"]))
        copies = statistics.median(periods["copies"])
        rows.append(
            {
                "case": "in-memory copy every step",
                "s_per_step": round(copies, 4),
                "runs_s": periods["copies"],
                "added_ms_per_step": round((copies - base) * 1e3, 1),
                "ratio": round(ratio, 3),
                "target": f"<= {COPIES_TARGET}",
                "status": "PASS" if ratio <= COPIES_TARGET else "FAIL",
            }
        )
        missed += [] if ratio <= COPIES_TARGET else ["copies"]
    if "checkpoint" in cases:
        steps = WARMUP + WINDOWS * CALIBRATION_EVERY
        calibration = run("sync_calibrate", steps, checkpointing(CALIBRATION_EVERY, False))
        save_s = (calibration - base) * CALIBRATION_EVERY
        # The largest N with save / (N steps + save) >= SYNC_SHARE_MIN.
        # Capped (to bound the run): a smaller N saves more often, which only makes the async
        # target harder, and raises the synchronous save's share.
        every = min(max(2, int(save_s * (1 / SYNC_SHARE_MIN - 1) / base)), 4 if args.smoke else 50)
        steps = WARMUP + WINDOWS * every
        sync = run(f"sync_{every}", steps, checkpointing(every, False))
        background = run(f"async_{every}", steps, checkpointing(every, True))
        share = 1 - base / sync
        ratio = background / base
        met = ratio <= CHECKPOINT_TARGET and share >= SYNC_SHARE_MIN
        rows.append(
            {
                "case": f"checkpoint every {every} steps (a sync save {save_s:.2f} s)",
                "s_per_step": round(background, 4),
                "sync_s_per_step": round(sync, 4),
                "sync_share_of_window": f"{share:.1%}",
                "ratio": round(ratio, 3),
                "target": f"<= {CHECKPOINT_TARGET}, sync share >= {SYNC_SHARE_MIN:.0%}",
                "status": "PASS" if met else "FAIL",
            }
        )
        missed += [] if met else ["checkpoint"]
    if args.smoke:  # never over the published figures
        print(*rows, sep="\n")
        return 0
    name = torch.cuda.get_device_name()
    record = common.write_result(
        "gpu_state",
        "Keeping state on one GPU: in-memory copies and async checkpoints",
        shlex.join(["python", "bench/bench_gpu_state.py", *sys.argv[1:]]),
        f"copies of every step <= {COPIES_TARGET}x, async checkpoint every N steps <= "
        f"{CHECKPOINT_TARGET}x, against the same run with neither",
        rows,
        notes=f"1 x {name}, torch {torch.__version__}; ~270M-parameter Llama, seq {SEQ_LEN}, "
        f"global batch {GLOBAL_BATCH} (micro {MICRO_BATCH}), bf16, FSDP2 on one rank; first "
        f"{WARMUP} steps dropped",
    )
    for row in rows:
        print(row)
    print(f"wrote {record}; {'FAIL: ' + ', '.join(missed) if missed else 'PASS'}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
