"""Benchmark: checkpoint costs on CPU with a ~60M-parameter model.

(a) How long training stalls for an async FSDP2 save (staging to CPU memory) against the time
    of a synchronous save of the same state: 2 ranks (torch.multiprocessing, gloo, ZeRO-3),
    the engine's own `save` and `save_async`, median over repeats.
(b) Peak RSS of `raytrain-dt ckpt consolidate` on the same checkpoint, against the model's
    size and the RSS of a process that only imports what the command imports.

Prints one line per result and writes bench/results/checkpoint.json.
Run: python bench/bench_checkpoint.py [--repeats N]
"""

from __future__ import annotations

import argparse
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
    import torch.distributed as dist

    from raytrain_dt.config.schema import TrainConfig
    from raytrain_dt.engines.fsdp2 import FSDP2Engine
    from raytrain_dt.models.llama import build_model
    from raytrain_dt.models.presets import ModelShape
    from raytrain_dt.topology.layout import Layout
    from raytrain_dt.topology.parallel_dims import ParallelDims
    from raytrain_dt.worker.device import select_device

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    device = select_device("fp32")
    layout = Layout(ParallelDims(world_size=WORLD, dp_shard=WORLD), 3, 1, 1)
    mesh = layout.dims.build_mesh(device.device_type)
    engine = FSDP2Engine(build_model(ModelShape(**SHAPE), SEQ_LEN, 0), TrainConfig(), layout,
                         mesh, device)  # fmt: skip
    engine._state_dicts()  # creates the AdamW moments, as after a first step
    write_group = dist.new_group(backend="gloo")
    sync, stall, async_total = [], [], []
    for i in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        engine.save(f"{root}/sync_{i}")
        dist.barrier()
        sync.append(time.perf_counter() - t0)
    for i in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        future = engine.save_async(f"{root}/async_{i}", write_group)
        stall.append(time.perf_counter() - t0)  # what the train loop waits for
        future.result()
        dist.barrier()
        async_total.append(time.perf_counter() - t0)
    results.put((rank, sync, stall, async_total))
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
    size = sum(f.stat().st_size for f in (root / "sync_0").iterdir())
    return {"sync_s": sync, "stall_s": stall, "async_total_s": total, "bytes": size}


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
    return {"peak_rss": peak, "baseline_rss": baseline, "model_bytes": model_bytes,
            "seconds": seconds}  # fmt: skip


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
                      "sync_s": [round(x, 3) for x in save["sync_s"]],
                      "stall_s": [round(x, 3) for x in save["stall_s"]]})  # fmt: skip
        print(f"save {save['bytes'] / 1e6:.0f} MB: sync {sync:.3f} s, async stall {stall:.3f} s "
              f"({ratio:.1%} of sync; target <= 10%)")  # fmt: skip
        step_dir = root / "step_0"
        (root / "sync_0").rename(step_dir)
        cons = bench_consolidate(step_dir, Path(tmp) / "hf")
        extra = cons["peak_rss"] - cons["baseline_rss"]
        cases.append({"case": "ckpt consolidate", "model_bytes": cons["model_bytes"],
                      "peak_rss_bytes": cons["peak_rss"], "import_rss_bytes": cons["baseline_rss"],
                      "rss_above_imports_bytes": extra,
                      "rss_above_imports_over_model": round(extra / cons["model_bytes"], 3),
                      "seconds": round(cons["seconds"], 2)})  # fmt: skip
        print(f"consolidate {cons['model_bytes'] / 1e6:.0f} MB model: peak RSS "
              f"{cons['peak_rss'] / 1e6:.0f} MB ({cons['baseline_rss'] / 1e6:.0f} MB imports, "
              f"+{extra / 1e6:.0f} MB = {extra / cons['model_bytes']:.2f}x model)")  # fmt: skip
    record = {
        "title": "Checkpoint costs",
        "command": "python bench/bench_checkpoint.py",
        "target": "async save stall <= 10% of a synchronous save; consolidate's memory well "
        "below the model size (streamed tensor by tensor)",
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
