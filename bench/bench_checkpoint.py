"""Benchmark: checkpoint costs on CPU with a ~60M-parameter model.

(a) How long the train loop is blocked by an async FSDP2 save against a synchronous save of
    the same state: 2 ranks (torch.multiprocessing, gloo, ZeRO-3), median over repeats, the
    slowest rank per save. Blocked = `RankCheckpointer.save` (as called at a step boundary)
    plus the time the next step's optimizer waits for the staging copy, which runs during that
    step's forward and backward. The time of that next step is reported next to a plain step's
    (on CPU the copy and the writer share the cores with training). The first async save, which
    allocates the staging buffers once per run, is not counted.
(b) Peak RSS of `raytrain-dt ckpt consolidate` on the same checkpoint, against the model's
    size and the RSS of a process that only imports what the command imports.

Prints one line per result and writes bench/results/checkpoint.json.
Run: python bench/bench_checkpoint.py [--repeats N]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPE = {"dim": 512, "n_layers": 8, "n_heads": 8, "n_kv_heads": 8, "vocab_size": 32000,
         "ffn_hidden": 1408}  # fmt: skip
SEQ_LEN = 128
WORLD = 2


def _rank_main(rank: int, port: int, root: str, repeats: int, results) -> None:
    import torch
    import torch.distributed as dist

    from raytrain_dt.accel.device import select_device
    from raytrain_dt.config.schema import TrainConfig
    from raytrain_dt.engines.fsdp2 import FSDP2Engine
    from raytrain_dt.models.presets import ModelShape
    from raytrain_dt.models.spec import llama_spec
    from raytrain_dt.topology.layout import Layout
    from raytrain_dt.topology.parallel_dims import ParallelDims
    from raytrain_dt.worker.checkpointing import RankCheckpointer

    # One intra-op thread per rank, as inside the Ray actors (Ray sets OMP_NUM_THREADS=1).
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    device = select_device("fp32")
    layout = Layout(ParallelDims(world_size=WORLD, dp_shard=WORLD), 3, 1, 1)
    mesh = layout.dims.build_mesh(device.device_type)
    cfg = TrainConfig()
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=SEQ_LEN))
    engine = FSDP2Engine(llama_spec(ModelShape(**SHAPE)), cfg, layout, mesh, device)
    tokens = torch.randint(0, SHAPE["vocab_size"], (1, SEQ_LEN))

    def train_step(step: int) -> float:
        started = time.perf_counter()
        engine.train_step([tokens], step)
        return time.perf_counter() - started

    train_step(0)  # warm-up; creates the AdamW moments
    # What the train loop calls at a step boundary: it is blocked until `save` returns.
    sync_ckpt = RankCheckpointer(engine, rank, report=lambda _: None, use_async=False)
    async_ckpt = RankCheckpointer(engine, rank, report=lambda _: None, use_async=True)
    sync, stall, async_total, plain_steps, overlapped_steps = [], [], [], [], []
    for i in range(repeats):
        dist.barrier()
        plain_steps.append(train_step(1 + i))
        dist.barrier()
        t0 = time.perf_counter()
        sync_ckpt.save(f"{root}/sync_{i}", i)
        dist.barrier()
        sync.append(time.perf_counter() - t0)
    # One unmeasured async save first: it allocates the reusable staging buffers, once per run.
    for i in range(-1, repeats):
        dist.barrier()
        t0 = time.perf_counter()
        async_ckpt.save(f"{root}/async_{i}", i)
        returned = time.perf_counter() - t0
        # The next step runs while the shards are copied; its optimizer step waits for the copy.
        step_s = train_step(1 + repeats + i)
        blocked = returned + engine.staging_wait_s
        async_ckpt.wait()
        dist.barrier()
        if i >= 0:
            stall.append(blocked)
            overlapped_steps.append(step_s)
            async_total.append(time.perf_counter() - t0)
    results.put((rank, sync, stall, async_total, plain_steps, overlapped_steps))
    dist.destroy_process_group()


def bench_save(root: Path, repeats: int) -> dict:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, port, str(root), repeats, results))
             for r in range(WORLD)]  # fmt: skip
    for p in procs:
        p.start()
    per_rank = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    # Per save, the slowest rank is what the run sees.
    sync = [max(r[1][i] for r in per_rank) for i in range(repeats)]
    stall = [max(r[2][i] for r in per_rank) for i in range(repeats)]
    total = [max(r[3][i] for r in per_rank) for i in range(repeats)]
    plain = [max(r[4][i] for r in per_rank) for i in range(repeats)]
    overlapped = [max(r[5][i] for r in per_rank) for i in range(repeats)]
    size = sum(f.stat().st_size for f in (root / "sync_0").rglob("*") if f.is_file())
    return {"sync_s": sync, "stall_s": stall, "async_total_s": total, "bytes": size,
            "step_s": plain, "step_during_write_s": overlapped}  # fmt: skip


_MEASURE = """
import resource, sys
{body}
print("MAXRSS", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def peak_rss(body: str) -> int:
    """Peak RSS in bytes of a fresh Python process running `body`."""
    code = _MEASURE.format(body=body)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(next(line for line in out.stdout.splitlines() if line.startswith("MAXRSS"))[7:])


def bench_consolidate(checkpoint: Path, out: Path) -> dict:
    from raytrain_dt.checkpoint.export import model_tensors
    from raytrain_dt.checkpoint.store import CheckpointStore

    CheckpointStore(str(checkpoint.parent)).commit(
        0, {"engine": "fsdp2", "model_shape": SHAPE, "seq_len": SEQ_LEN, "step": 0}
    )
    imports = "import raytrain_dt.checkpoint.cli, raytrain_dt.checkpoint.export, raytrain_dt.cli"
    baseline = peak_rss(imports)
    t0 = time.perf_counter()
    run = f"{imports}\nraytrain_dt.cli.main(['ckpt', 'consolidate', {str(checkpoint)!r}, '--out', {str(out)!r}])"
    peak = peak_rss(run)
    seconds = time.perf_counter() - t0
    model_bytes = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    largest = max(size.numel() * dtype.itemsize
                  for size, dtype in model_tensors(str(checkpoint)).values())  # fmt: skip
    return {"peak_rss": peak, "baseline_rss": baseline, "model_bytes": model_bytes,
            "largest_tensor_bytes": largest, "seconds": seconds}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "checkpoint.json"))
    args = parser.parse_args()
    cases = []
    with tempfile.TemporaryDirectory(prefix="bench_ckpt_") as tmp:
        root = Path(tmp) / "checkpoints"
        save = bench_save(root, args.repeats)
        sync, stall = statistics.median(save["sync_s"]), statistics.median(save["stall_s"])
        ratio = stall / sync
        cases.append({"case": "fsdp2 save, 2 ranks zero=3", "state_bytes": save["bytes"],
                      "sync_save_median_s": round(sync, 3),
                      "async_stall_median_s": round(stall, 3),
                      "async_total_median_s": round(statistics.median(save["async_total_s"]), 3),
                      "stall_over_sync": round(ratio, 3), "repeats": args.repeats,
                      "train_step_median_s": round(statistics.median(save["step_s"]), 3),
                      "train_step_after_async_save_median_s":
                          round(statistics.median(save["step_during_write_s"]), 3),
                      "sync_s": [round(x, 3) for x in save["sync_s"]],
                      "stall_s": [round(x, 3) for x in save["stall_s"]]})  # fmt: skip
        print(f"save {save['bytes'] / 1e6:.0f} MB: sync {sync:.3f} s, async stall {stall:.3f} s "
              f"({ratio:.1%} of sync; target <= 10%); train step "
              f"{statistics.median(save['step_s']):.3f} s, the step after an async save "
              f"{statistics.median(save['step_during_write_s']):.3f} s")  # fmt: skip
        step_dir = root / "step_0"
        (root / "sync_0").rename(step_dir)
        cons = bench_consolidate(step_dir, Path(tmp) / "hf")
        extra = cons["peak_rss"] - cons["baseline_rss"]
        cases.append({"case": "ckpt consolidate", "model_bytes": cons["model_bytes"],
                      "peak_rss_bytes": cons["peak_rss"], "import_rss_bytes": cons["baseline_rss"],
                      "rss_above_imports_bytes": extra,
                      "rss_above_imports_over_model": round(extra / cons["model_bytes"], 3),
                      "largest_tensor_bytes": cons["largest_tensor_bytes"],
                      "rss_above_imports_over_largest_tensor":
                          round(extra / cons["largest_tensor_bytes"], 3),
                      "seconds": round(cons["seconds"], 2)})  # fmt: skip
        print(f"consolidate {cons['model_bytes'] / 1e6:.0f} MB model: peak RSS "
              f"{cons['peak_rss'] / 1e6:.0f} MB ({cons['baseline_rss'] / 1e6:.0f} MB imports, "
              f"+{extra / 1e6:.0f} MB = {extra / cons['model_bytes']:.2f}x model, "
              f"{extra / cons['largest_tensor_bytes']:.2f}x the largest tensor of "
              f"{cons['largest_tensor_bytes'] / 1e6:.0f} MB)")  # fmt: skip
    record = {
        "title": "Checkpoint costs",
        "command": "python bench/bench_checkpoint.py",
        "target": "async save stall <= 10% of a synchronous save; consolidate's memory near the "
        "largest tensor, not the model size (streamed tensor by tensor)",
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "cases": cases,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
