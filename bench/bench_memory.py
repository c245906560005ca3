"""Benchmark: per-rank model-state bytes the real engines hold vs the planner's memory model.

For each layout (CPU, fp32, gloo, up to 4 spawned ranks) one `train_step` of two micro-batches
of random tokens is run on the `small` preset (~10.8M parameters), with FSDP2 and with DeepSpeed
ZeRO-1/2/3, and every rank counts the bytes of its LOCAL shards (`DTensor.to_local()`, ZeRO
partitions, the storages DeepSpeed's optimizer holds):
- at the optimizer step: parameters, gradients and optimizer state (with DeepSpeed's fp32
  master partitions), compared with `topology.memory.model_state_bytes`;
- at the FSDP2 peak: the parameters held while blocks are all-gathered (including a prefetched
  block and unsharded roots) and the gradients held while accumulating or before a block's
  reduce-scatter, compared with `model_state_bytes + working_state_bytes`.
The max over ranks is printed beside the planner's figures and written to
bench/results/memory.json; every ratio must lie within 10%. Run: python bench/bench_memory.py
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import multiprocessing as mp
import os
import platform
import socket
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import memory_probe

REPO = Path(__file__).resolve().parent.parent
PRESET = "small"
SEQ_LEN = 64
GLOBAL_BATCH = 8
GRAD_ACCUM = 2
TOLERANCE = 0.10
MB = 1e6
JOB_TIMEOUT_S = 240

# (name, engine, zero_stage, parallel degrees)
LAYOUTS = [
    ("ddp", "fsdp2", 0, {"dp_replicate": 2}),
    ("fsdp2-zero1 dp2", "fsdp2", 1, {"dp_shard": 2}),
    ("fsdp2-grad-op dp2", "fsdp2", 2, {"dp_shard": 2}),
    ("fsdp2-full dp2", "fsdp2", 3, {"dp_shard": 2}),
    # engine.grad_sync=final: unsharded gradients held across micro-steps.
    ("fsdp2-full dp2 deferred", "fsdp2", 3, {"dp_shard": 2, "defer_grad_sync": True}),
    ("fsdp2-full dp4", "fsdp2", 3, {"dp_shard": 4}),
    ("tp2", "fsdp2", 3, {"tp": 2}),
    ("dp2xtp2", "fsdp2", 3, {"dp_shard": 2, "tp": 2}),
    ("pp2", "fsdp2", 3, {"pp": 2}),
    ("pp2xdp2", "fsdp2", 3, {"pp": 2, "dp_shard": 2}),
    ("ds-zero1 dp2", "deepspeed", 1, {"dp_shard": 2}),
    ("ds-zero2 dp2", "deepspeed", 2, {"dp_shard": 2}),
    ("ds-zero3 dp2", "deepspeed", 3, {"dp_shard": 2}),
    # ZeRO-1 over pipeline stages: each stage's states sharded over its DP ranks.
    ("ds-zero1 pp2", "deepspeed", 1, {"pp": 2}),
    ("ds-zero1 pp2xdp2", "deepspeed", 1, {"pp": 2, "dp_shard": 2}),
]


def make_layout(zero: int, degrees: dict):
    from raytrain_dt.topology.layout import Layout
    from raytrain_dt.topology.parallel_dims import ParallelDims

    degrees = dict(degrees)
    defer = degrees.pop("defer_grad_sync", False)
    world = 1
    for v in degrees.values():
        world *= v
    dims = ParallelDims(world_size=world, **degrees)
    return Layout(
        dims=dims,
        zero_stage=zero,
        micro_batch=GLOBAL_BATCH // (GRAD_ACCUM * dims.dp),
        grad_accum=GRAD_ACCUM,
        defer_grad_sync=defer,
    )


def make_config(engine: str = "fsdp2"):
    from raytrain_dt.config import load_config

    return load_config(
        REPO / "conf" / "test.yaml",
        [
            f"engine.name={engine}",
            f"model.preset={PRESET}",
            f"data.seq_len={SEQ_LEN}",
            f"trainer.global_batch={GLOBAL_BATCH}",
        ],
    )


def _measure_rank(rank: int, engine_name: str, zero: int, degrees: dict, port: int) -> dict:
    import torch
    import torch.distributed as dist

    from raytrain_dt.accel.device import select_device
    from raytrain_dt.engines.base import EngineBuild
    from raytrain_dt.engines.factory import build_engine
    from raytrain_dt.models.model_spec import model_spec
    from raytrain_dt.parallel.device_mesh import build_mesh

    cfg, layout = make_config(engine_name), make_layout(zero, degrees)
    dims = layout.dims
    # DeepSpeed reads the rendezvous from the environment even over an existing group.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(dims.world_size), LOCAL_RANK="0")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=dims.world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        mesh = build_mesh(dims, "cpu")
        engine = build_engine(
            EngineBuild(model_spec(cfg), cfg, layout, mesh, select_device("fp32"))
        )
        out: dict = {"rank": rank, "accum_grads": None, "fwd_params": None}
        if engine_name == "deepspeed":
            memory_probe.instrument_deepspeed(engine, out)
        else:
            memory_probe.instrument_fsdp2(engine, out)
        gen = torch.Generator().manual_seed(1234 + dims.coords(rank).dp)
        rows = torch.randint(0, 256, (GLOBAL_BATCH // dims.dp, SEQ_LEN), generator=gen)
        start = time.perf_counter()
        engine.train_step(list(torch.split(rows, layout.micro_batch)), 0)
        out["step_s"] = time.perf_counter() - start
        dist.barrier()
        return out
    finally:
        dist.destroy_process_group()


def _worker_main(rank: int, conn) -> None:
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    while True:
        job = conn.recv()
        if job is None:
            return
        engine_name, zero, degrees, port, world = job
        if rank >= world:
            conn.send(("idle", None))
            continue
        try:
            conn.send(("ok", _measure_rank(rank, engine_name, zero, degrees, port)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def planner_bytes(shape, engine: str, layout) -> tuple[tuple, tuple]:
    """The planner's (params, grads, optimizer) at rest and at the forward/backward peak."""
    from raytrain_dt.topology.memory import model_state_bytes, working_state_bytes

    d = layout.dims
    degrees = {"tp": d.tp, "pp": d.pp, "shard": d.dp_shard, "zero_stage": layout.zero_stage}
    rest = model_state_bytes(shape, **degrees, precision="fp32", engine=engine)
    extra = working_state_bytes(
        shape,
        **degrees,
        precision="fp32",
        engine=engine,
        grad_accum=layout.grad_accum,
        defer_grad_sync=layout.defer_grad_sync,
    )
    return rest, (rest[0] + extra[0], rest[1] + extra[1], rest[2])


class _Pool:
    """`size` spawned ranks that measure one layout after another."""

    def __init__(self, size: int):
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for rank in range(size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(rank, child), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def run(self, name: str, job: tuple) -> list:
        for conn in self.conns:
            conn.send(job)
        replies = []
        for rank, conn in enumerate(self.conns):
            if not conn.poll(JOB_TIMEOUT_S):
                raise TimeoutError(f"rank {rank} gave no answer for {name}")
            replies.append(conn.recv())
        return replies

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs, strict=True):
            if proc.is_alive():
                with contextlib.suppress(OSError):
                    conn.send(None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)


def _max(ranks: list[dict], key: str) -> float | None:
    values = [r[key] for r in ranks if r[key] is not None]
    return max(values) if values else None


def _compare(name, engine_name, layout, ranks, shape) -> dict:
    """One result row: measured bytes (max over ranks) beside the planner's, at rest and peak."""
    rest_plan, peak_plan = planner_bytes(shape, engine_name, layout)
    measured = {k: _max(ranks, k) for k in ("params", "grads", "optim")}
    total = max(r["params"] + r["grads"] + r["optim"] for r in ranks)
    ratio = total / sum(rest_plan)
    ok = abs(ratio - 1.0) <= TOLERANCE
    row = {
        "layout": name,
        "engine": engine_name,
        "dims": layout.dims.describe(),
        "zero_stage": layout.zero_stage,
        "world_size": layout.dims.world_size,
        **{f"{k}_mb": round(v / MB, 3) for k, v in measured.items()},
        "total_mb": round(total / MB, 3),
        **{f"plan_{k}_mb": round(v / MB, 3) for k, v in zip(measured, rest_plan, strict=True)},
        "plan_total_mb": round(sum(rest_plan) / MB, 3),
        "ratio": round(ratio, 4),
        "per_rank_total_mb": [
            round((r["params"] + r["grads"] + r["optim"]) / MB, 3) for r in ranks
        ],
        "step_s": round(max(r["step_s"] for r in ranks), 3),
    }
    accum = _max(ranks, "accum_grads")
    row["accum_grads_mb"] = None if accum is None else round(accum / MB, 3)
    # Peak: parameters held during forward/backward, gradients between micro-steps or at the
    # step, whichever is larger. Measured for FSDP2 only (DeepSpeed's buffers are internal).
    peak_params = _max(ranks, "fwd_params")
    if peak_params is not None:
        peak_grads = max(measured["grads"], _max(ranks, "accum_grads") or 0)
        peak = peak_params + peak_grads + measured["optim"]
        peak_ratio = peak / sum(peak_plan)
        ok = ok and abs(peak_ratio - 1.0) <= TOLERANCE
        row.update(
            peak_params_mb=round(peak_params / MB, 3),
            peak_grads_mb=round(peak_grads / MB, 3),
            peak_total_mb=round(peak / MB, 3),
            plan_peak_params_mb=round(peak_plan[0] / MB, 3),
            plan_peak_grads_mb=round(peak_plan[1] / MB, 3),
            plan_peak_total_mb=round(sum(peak_plan) / MB, 3),
            peak_ratio=round(peak_ratio, 4),
        )
    row["status"] = "PASS" if ok else "FAIL"
    return row


def _print_row(row: dict) -> None:
    rest = "/".join(f"{row[k]:.1f}" for k in ("params_mb", "grads_mb", "optim_mb"))
    plan = "/".join(f"{row[k]:.1f}" for k in ("plan_params_mb", "plan_grads_mb", "plan_optim_mb"))
    peak, plan_peak, peak_ratio = "n/a", "n/a", "n/a"
    if "peak_ratio" in row:
        peak = f"{row['peak_params_mb']:.1f}/{row['peak_grads_mb']:.1f}"
        plan_peak = f"{row['plan_peak_params_mb']:.1f}/{row['plan_peak_grads_mb']:.1f}"
        peak_ratio = f"{row['peak_ratio']:.3f}"
    print(
        f"{row['layout']:<18} {row['zero_stage']:>4} {rest:>16} {plan:>16} {row['ratio']:>6.3f}  "
        f"{peak:>11} {plan_peak:>11} {peak_ratio:>6}  {row['status']}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "memory.json"))
    parser.add_argument("--only", nargs="*", help="layout names to run (default: all)")
    args = parser.parse_args()

    from raytrain_dt.control.run_setup import model_shape

    shape = model_shape(make_config())
    layouts = [c for c in LAYOUTS if not args.only or c[0] in args.only]
    print(f"{PRESET}: {shape.num_params / 1e6:.2f}M params, fp32, MB per rank (max over ranks)")
    print(
        f"{'layout':<18} {'zero':>4} {'rest p/g/o':>16} {'plan p/g/o':>16} {'ratio':>6}  "
        f"{'peak p/g':>11} {'plan p/g':>11} {'ratio':>6}"
    )
    results, failures = [], 0
    fsdp2_pool: _Pool | None = None
    try:
        for name, engine_name, zero, degrees in layouts:
            layout = make_layout(zero, degrees)
            world = layout.dims.world_size
            job = (engine_name, zero, degrees, _free_port(), world)
            if engine_name == "deepspeed":
                # DeepSpeed cannot initialise twice in one process: fresh ranks per layout.
                pool = _Pool(world)
                try:
                    replies = pool.run(name, job)
                finally:
                    pool.close()
            else:
                if fsdp2_pool is None:
                    fsdp2_pool = _Pool(
                        max(make_layout(z, d).dims.world_size for *_, z, d in layouts)
                    )
                replies = fsdp2_pool.run(name, job)
            errors = [body for kind, body in replies if kind == "error"]
            if errors:
                failures += 1
                print(f"{name:<18} FAILED\n{errors[0]}")
                results.append({"layout": name, "error": errors[0].strip().splitlines()[-1]})
                continue
            row = _compare(name, engine_name, layout, [b for k, b in replies if k == "ok"], shape)
            failures += row["status"] != "PASS"
            results.append(row)
            _print_row(row)
    finally:
        if fsdp2_pool is not None:
            fsdp2_pool.close()

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "title": "Model-state memory per rank: FSDP2 and DeepSpeed engines vs planner",
        "command": "python bench/bench_memory.py",
        "target": (
            f"measured params+grads+optimizer within {TOLERANCE:.0%} of the planner's "
            "model_state_bytes at rest and, for FSDP2, of model_state_bytes + "
            "working_state_bytes at the forward/backward peak"
        ),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "model": f"{PRESET} ({shape.num_params} params), seq_len {SEQ_LEN}, fp32, gloo, CPU",
        "cases": results,
    }
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
