"""Benchmark: checkpoint costs on CPU with a ~60M-parameter model.

(a) What a checkpoint every N steps costs the train loop: 2 ranks (torch.multiprocessing,
    gloo, FSDP2 ZeRO-3) train in windows of N steps, each ending with a save at the step
    boundary as the train loop makes it, and the window's time (slowest rank) is compared with
    the same N steps without a checkpoint. An async save's background write overlaps the next
    window's steps, which it slows down (on CPU the staging copy and the writer share the cores
    with training): the window's time holds that slowdown, the save call, and any wait for the
    previous write, so nothing the save costs is left out. N is picked where a synchronous save
    is at least 10% of its window (the largest such N, from a calibration step and save; or
    `--every`). Target: async overhead <= 2% of the window without a checkpoint, with the
    synchronous save >= 10% of its window (else the row fails: it would not test the target).
    The three kinds of window take turns (so load from elsewhere weighs on each alike), and
    the async window is the one that a previous save's write overlaps. The first async save of
    a run, which allocates the staging buffers, is not timed. Measured twice: with 2 ranks
    training on this host's 2 cores (the target's row: the background write takes its CPU from
    training), and with 1 rank holding the same state, a core left free for the writer, as on
    a GPU host, where training runs on the accelerator and the host's cores wait. One thing
    that row still shares with training, unlike a GPU host: the host's memory bandwidth. The
    staging copy and the write move the state's bytes through memory several times, and the
    training thread's own CPU time grows while they do (4.35 s to 4.4-4.7 s per window here).
(b) Peak RSS of `raytrain-dt ckpt consolidate` on the same checkpoint, against the model's
    size and the RSS of a process that only imports what the command imports. Target: at most
    3x the largest tensor above the imports (streamed tensor by tensor: one read, one written,
    slack), not the model's size.
(c) The driver's commit time for checkpoints of 100 MB, 1 GB and 4 GB, and the checkpoint
    bytes it reads while committing (counted by instrumenting every open and read of the
    process). Synthetic rank files are written as ranks write them, hashed on the way out, and
    their digests reported; only the driver's merge of the reports and `CheckpointStore.commit`
    are timed (median over repeats). Target: flat (largest within 2x of smallest) with 0 bytes
    read; the script exits 1 when it is missed. Beside it, the ranks' cost of writing: the
    checksum alone (XXH3-128; SHA-256 beside it), and the same shards written and fsynced as
    DCP writes them (around the page cache) with and without hashing on the way out, and
    through the page cache, in turn, with the kernel CPU each write costs; the fastest of a
    few repeats each.

(d) The GIL the async write takes from the training thread (bench/checkpoint_gil.py): on a GPU
    host the training thread launches kernels in Python, and the writer's GIL is time it
    cannot. No target of its own.

Prints one line per result and writes bench/results/checkpoint.json (a run of some parts keeps
the other parts' last results); exits 1 when any target is missed.
Run: python bench/bench_checkpoint.py [--windows W] [--every N] [--parts save,commit,gil]
(save: (a) and (b)). `--smoke`: a tiny model, one window of 2 steps, commit sizes / 100, one
repeat each, written to runs/bench/checkpoint_smoke.json: checks that the script works (a few
minutes on a busy 2-core machine); its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from checkpoint_commit import (
    CHUNK,
    COMMIT_SIZES,
    COMMIT_TABLE,
    HASHING_TABLE,
    bench_commit,
    bench_hashing,
    commit_target_met,
)
from checkpoint_gil import GIL_TABLE, bench_write_gil, rank_engine

SHAPE = {
    "dim": 512,
    "n_layers": 8,
    "n_heads": 8,
    "n_kv_heads": 8,
    "vocab_size": 32000,
    "ffn_hidden": 1408,
}
SMOKE_SHAPE = {**SHAPE, "dim": 64, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2, "ffn_hidden": 128}
SMOKE_SHAPE["vocab_size"] = 1000
SEQ_LEN = 128
WORLD = 2
# (a) again with one rank: a host core free for the background write, as on a GPU host.
FREE_CORE_WORLD = 1
# (a): the target, and the synchronous save's least share of its window for it to apply.
OVERHEAD_TARGET = 0.02
SYNC_SHARE_MIN = 0.10
# (b): consolidate's RSS above its imports, in units of the largest tensor.
CONSOLIDATE_TARGET = 3.0


def _rank_main(
    rank: int,
    port: int,
    root: str,
    shape: dict,
    windows: int,
    every: int,
    world: int,
    writer: str,
    results,
):
    import itertools

    import torch
    import torch.distributed as dist

    from raytrain_dt.worker.checkpointing import RankCheckpointer

    engine, device = rank_engine(shape, SEQ_LEN, world, rank, port, writer)
    tokens = torch.randint(0, shape["vocab_size"], (1, SEQ_LEN))
    steps = itertools.count()

    def train_step() -> float:
        started = time.perf_counter()
        engine.train_step([tokens], next(steps))
        return time.perf_counter() - started

    def timed_save(ckpt: RankCheckpointer, uri: str) -> float:
        started = time.perf_counter()
        ckpt.save(uri, 0)
        return time.perf_counter() - started

    train_step()  # warm-up; creates the AdamW moments
    # What the train loop calls at a step boundary: it is blocked until `save` returns.
    sync_ckpt = RankCheckpointer(
        engine, rank, report=lambda _: None, use_async=False, device=device
    )
    async_ckpt = RankCheckpointer(
        engine, rank, report=lambda _: None, use_async=True, device=device
    )

    # Calibration, for N: a step and a synchronous save (the best of two; the slowest rank's).
    step_s, save_s = [], []
    for i in range(2):
        dist.barrier()
        step_s.append(train_step())
        dist.barrier()
        save_s.append(timed_save(sync_ckpt, f"{root}/calibrate_{i}"))
        dist.barrier()
    measured = torch.tensor([min(step_s), min(save_s)], dtype=torch.float64)
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    step, save = measured.tolist()
    # The largest N with the synchronous save >= SYNC_SHARE_MIN of its window (N steps + save).
    every = every or max(1, int(save * (1 / SYNC_SHARE_MIN - 1) / step))

    def window(ckpt: RankCheckpointer | None, uri: str) -> tuple[float, float]:
        """N steps, then the checkpoint at the step boundary: (window seconds, save call)."""
        dist.barrier()
        started = time.perf_counter()
        for _ in range(every):
            train_step()
        call = timed_save(ckpt, uri) if ckpt is not None else 0.0
        dist.barrier()
        return time.perf_counter() - started, call

    # Untimed: the first async save of a run allocates the staging buffers and sets up the
    # writer, once.
    async_ckpt.save(f"{root}/async_first", 0)
    async_ckpt.wait()
    # The three kinds of window in turn, so that the host's other work weighs on each alike.
    # The window without a checkpoint ends with an async save (after its time is taken) whose
    # write overlaps the async window after it, as in a run each save's write overlaps the
    # next window; that window's own save is waited for untimed, so the next cycle starts clean.
    plain, sync, overlapped = [], [], []
    for w in range(windows):
        sync.append(window(sync_ckpt, f"{root}/sync_{w}"))
        plain.append(window(None, "")[0])
        async_ckpt.save(f"{root}/async_lead_in_{w}", 0)
        overlapped.append(window(async_ckpt, f"{root}/async_{w}"))
        async_ckpt.wait()
        dist.barrier()
    results.put((rank, every, plain, sync, overlapped))
    dist.destroy_process_group()


def bench_save(
    root: Path, shape: dict, windows: int, every: int, world: int = WORLD, writer: str = "process"
) -> dict:
    """(a): the windows' seconds and the save calls', per window the slowest rank's; `writer`:
    `checkpoint.async_writer`."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    args = (port, str(root), shape, windows, every, world, writer, results)
    procs = [ctx.Process(target=_rank_main, args=(r, *args)) for r in range(world)]
    for p in procs:
        p.start()
    per_rank = [results.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join()

    def slowest(index: int, part: int | None = None) -> list[float]:
        pick = (lambda x: x) if part is None else (lambda x: x[part])
        return [max(pick(r[index][w]) for r in per_rank) for w in range(windows)]

    size = sum(f.stat().st_size for f in (root / "sync_0").rglob("*") if f.is_file())
    return {
        "every": per_rank[0][1],
        "plain_window_s": slowest(2),
        "sync_window_s": slowest(3, 0),
        "sync_save_s": slowest(3, 1),
        "async_window_s": slowest(4, 0),
        "async_save_call_s": slowest(4, 1),
        "bytes": size,
    }


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
    from raytrain_dt.checkpoint.digests import digest_tree
    from raytrain_dt.checkpoint.export import model_tensors
    from raytrain_dt.checkpoint.store import CheckpointStore

    CheckpointStore(str(checkpoint.parent)).commit(
        0,
        {"engine": "fsdp2", "model_shape": SHAPE, "seq_len": SEQ_LEN, "step": 0},
        digest_tree(str(checkpoint)),  # here this process stands for the ranks that wrote it
    )
    imports = "import raytrain_dt.ckpt_cli, raytrain_dt.checkpoint.export, raytrain_dt.cli"
    baseline = peak_rss(imports)
    t0 = time.perf_counter()
    run = f"{imports}\nraytrain_dt.cli.main(['ckpt', 'consolidate', {str(checkpoint)!r}, '--out', {str(out)!r}])"
    peak = peak_rss(run)
    seconds = time.perf_counter() - t0
    model_bytes = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    largest = max(
        size.numel() * dtype.itemsize for size, dtype in model_tensors(str(checkpoint)).values()
    )
    return {
        "peak_rss": peak,
        "baseline_rss": baseline,
        "model_bytes": model_bytes,
        "largest_tensor_bytes": largest,
        "seconds": seconds,
    }


def save_case(
    root: Path, shape: dict, windows: int, every: int, world: int, writer: str = "process"
) -> tuple[dict, bool]:
    """(a) at `world` ranks: its case, and whether it met the target."""
    save = bench_save(root, shape, windows, every, world, writer)
    med = {k: statistics.median(v) for k, v in save.items() if isinstance(v, list)}

    def per_cycle(over: str, under: str) -> float:
        """The median over the cycles of one window's time over the other's (the windows of
        one cycle ran back to back, under the same load from elsewhere)."""
        return statistics.median(o / u for o, u in zip(save[over], save[under]))

    overhead = per_cycle("async_window_s", "plain_window_s") - 1
    sync_overhead = per_cycle("sync_window_s", "plain_window_s") - 1
    sync_share = per_cycle("sync_save_s", "sync_window_s")
    saved_met = overhead <= OVERHEAD_TARGET and sync_share >= SYNC_SHARE_MIN
    ranks = (
        f"{world} ranks zero=3 (both cores train)"
        if world == WORLD
        else f"{world} rank (a core free for the writer, as on a GPU host)"
    )
    case = {
        "case": f"fsdp2 save every {save['every']} steps, {ranks}",
        "state_bytes": save["bytes"],
        "windows": windows,
        "window_no_checkpoint_s": round(med["plain_window_s"], 3),
        "window_sync_s": round(med["sync_window_s"], 3),
        "sync_save_s": round(med["sync_save_s"], 3),
        "sync_save_share_of_window": f"{sync_share:.1%}",
        "sync_overhead": f"{sync_overhead:.1%}",
        "window_async_s": round(med["async_window_s"], 3),
        "async_save_call_s": round(med["async_save_call_s"], 3),
        # What an async save costs the loop in all, its overlapped steps' slowdown included.
        "async_cost_per_save_s": round(med["async_window_s"] - med["plain_window_s"], 3),
        "async_overhead": f"{overhead:.1%}",
        "target": f"async overhead <= {OVERHEAD_TARGET:.0%}, sync share >= {SYNC_SHARE_MIN:.0%}",
        "status": "PASS" if saved_met else "FAIL",
        "per_window_s (none/sync/async)": "/".join(
            ",".join(f"{x:.2f}" for x in save[k])
            for k in ("plain_window_s", "sync_window_s", "async_window_s")
        ),
    }
    print(
        f"{'PASS' if saved_met else 'FAIL'}: {world} rank(s), checkpoint every {save['every']} steps "
        f"({save['bytes'] / 1e6:.0f} MB): async overhead {overhead:.1%} of the window "
        f"(target <= {OVERHEAD_TARGET:.0%}; {med['async_window_s']:.2f} s vs "
        f"{med['plain_window_s']:.2f} s without a checkpoint; the save call alone "
        f"{med['async_save_call_s']:.3f} s); a synchronous save is {sync_share:.1%} of its "
        f"window (must be >= {SYNC_SHARE_MIN:.0%}), overhead {sync_overhead:.1%}"
    )
    return case, saved_met


def bench_save_and_consolidate(
    tmp: Path, shape: dict, windows: int, every: int
) -> tuple[list[dict], bool]:
    """(a), at both worlds, and (b): their cases, and whether the target's row of (a) (both
    cores training) and (b) met their targets."""
    root = Path(tmp) / "checkpoints"
    case, saved_met = save_case(root, shape, windows, every, WORLD)
    free_core, _ = save_case(Path(tmp) / "free_core", shape, windows, every, FREE_CORE_WORLD)
    cases = [case, free_core]
    step_dir = root / "step_0"
    (root / "sync_0").rename(step_dir)
    cons = bench_consolidate(step_dir, Path(tmp) / "hf")
    extra = cons["peak_rss"] - cons["baseline_rss"]
    over_largest = extra / cons["largest_tensor_bytes"]
    consolidate_met = over_largest <= CONSOLIDATE_TARGET
    cases.append(
        {
            "case": "ckpt consolidate",
            "model_bytes": cons["model_bytes"],
            "peak_rss_bytes": cons["peak_rss"],
            "import_rss_bytes": cons["baseline_rss"],
            "rss_above_imports_bytes": extra,
            "rss_above_imports_over_model": round(extra / cons["model_bytes"], 3),
            "largest_tensor_bytes": cons["largest_tensor_bytes"],
            "rss_above_imports_over_largest_tensor": round(over_largest, 3),
            "seconds": round(cons["seconds"], 2),
            "target": f"<= {CONSOLIDATE_TARGET:g}x the largest tensor",
            "status": "PASS" if consolidate_met else "FAIL",
        }
    )
    print(
        f"{'PASS' if consolidate_met else 'FAIL'}: consolidate {cons['model_bytes'] / 1e6:.0f} "
        f"MB model: peak RSS {cons['peak_rss'] / 1e6:.0f} MB ({cons['baseline_rss'] / 1e6:.0f} "
        f"MB imports, +{extra / 1e6:.0f} MB = {extra / cons['model_bytes']:.2f}x model, "
        f"{over_largest:.2f}x the largest tensor of "
        f"{cons['largest_tensor_bytes'] / 1e6:.0f} MB; target <= {CONSOLIDATE_TARGET:g}x)"
    )
    return cases, saved_met and consolidate_met


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=3, help="(a): timed windows per policy")
    parser.add_argument(
        "--every", type=int, default=0, help="(a): N; 0 picks it (sync save >= 10%% of a window)"
    )
    parser.add_argument("--commit-repeats", type=int, default=41)
    parser.add_argument("--hash-repeats", type=int, default=3)
    parser.add_argument("--gil-repeats", type=int, default=3)
    parser.add_argument(
        "--parts", default="save,commit,gil", help="save: (a) and (b); commit: (c); gil: (d)"
    )
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "checkpoint.json"))
    parser.add_argument("--smoke", action="store_true", help="check the script works (see top)")
    args = parser.parse_args()
    shape, sizes = SHAPE, COMMIT_SIZES
    if args.smoke:
        shape = SMOKE_SHAPE
        sizes = {f"{label} / 100": size // 100 for label, size in COMMIT_SIZES.items()}
        args.windows, args.every = 1, args.every or 2
        args.commit_repeats = args.hash_repeats = 1
        if args.out == parser.get_default("out"):  # never over the published figures
            args.out = str(Path(__file__).resolve().parents[1] / "runs/bench/checkpoint_smoke.json")
    parts = set(args.parts.split(","))
    out = Path(args.out)
    # A run of some parts keeps the other parts' last results.
    previous = json.loads(out.read_text()) if out.exists() else {}
    cases = previous.get("cases", [])
    tables = {table["title"]: table for table in previous.get("tables", [])}
    missed = []
    with tempfile.TemporaryDirectory(prefix="bench_ckpt_") as tmp:
        if "save" in parts:
            cases, met = bench_save_and_consolidate(Path(tmp), shape, args.windows, args.every)
            missed += [] if met else ["save or consolidate"]
        if "commit" in parts:
            commits = bench_commit(Path(tmp), args.commit_repeats, sizes)
            hashing = bench_hashing(Path(tmp), os.urandom(CHUNK), args.hash_repeats, sizes)
            if not commit_target_met(commits):
                print("FAIL: driver commit not flat within 2x, or checkpoint bytes were read")
                missed.append("commit")
            tables[COMMIT_TABLE] = {"title": COMMIT_TABLE, "cases": commits}
            tables[HASHING_TABLE] = {"title": HASHING_TABLE, "cases": hashing}
        if "gil" in parts:
            gil = bench_write_gil(Path(tmp) / "gil", shape, SEQ_LEN, args.gil_repeats)
            tables[GIL_TABLE] = {"title": GIL_TABLE, "cases": gil}
    now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    # When each part was measured: a run of some parts keeps the others' figures and dates.
    measured = previous.get("part_measured_at", {}) | {part: now for part in parts}
    record = {
        "title": "Checkpoint costs",
        # As run; a run of some parts says when the parts it kept were measured.
        "command": shlex.join(["python", "bench/bench_checkpoint.py", *sys.argv[1:]]),
        "target": f"a checkpoint every N steps costs an async save <= {OVERHEAD_TARGET:.0%} of "
        f"the N steps' time without one, at an N where a synchronous save is >= "
        f"{SYNC_SHARE_MIN:.0%} of its window (the slowdown of the steps that overlap the "
        f"background write included); consolidate's memory <= {CONSOLIDATE_TARGET:g}x the "
        "largest tensor, not the model size (streamed tensor by tensor); the driver's commit "
        "time flat in the checkpoint's size (within 2x from 100 MB to 4 GB) with 0 checkpoint "
        "bytes read",
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "measured_at": now,
        "part_measured_at": measured,
        "notes": f"1-min load average at the end {os.getloadavg()[0]:.1f}"
        + "".join(
            f"; the {part} part kept from the run of {measured.get(part, '?')}"
            for part in sorted({"save", "commit", "gil"} - parts)
            if part in measured
        )
        + (
            "; SMOKE RUN (--smoke): tiny model and sizes, figures mean nothing"
            if args.smoke
            else ""
        ),
        "cases": cases,
        "tables": [tables[t] for t in (COMMIT_TABLE, HASHING_TABLE, GIL_TABLE) if t in tables],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
