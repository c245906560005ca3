"""Benchmark: per-rank model-state bytes the real FSDP2 engine holds vs the planner's estimate.

For each layout (CPU, fp32, gloo, up to 4 spawned ranks) one `train_step` of two micro-batches
of random tokens is run on the `small` preset (~10.8M parameters). Right after the optimizer
step, before `zero_grad`, every rank counts the bytes of its LOCAL shards (`DTensor.to_local()`)
of parameters, `.grad`s and every tensor in `optimizer.state`; between the two micro-batches it
also counts the gradients held while accumulating (FSDP2's unsharded `.grad` buffers, which
`set_requires_gradient_sync(False)` keeps until the last micro-batch reduce-scatters them).
The max over ranks is printed beside `topology.memory.model_state_bytes` for the same layout,
and written to bench/results/memory.json. Run: python bench/bench_memory.py
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

REPO = Path(__file__).resolve().parent.parent
PRESET = "small"
SEQ_LEN = 64
GLOBAL_BATCH = 8
GRAD_ACCUM = 2
TOLERANCE = 0.10
MB = 1e6
JOB_TIMEOUT_S = 240

# (name, zero_stage, parallel degrees)
LAYOUTS = [
    ("ddp", 0, {"dp_replicate": 2}),
    ("fsdp2-grad-op dp2", 2, {"dp_shard": 2}),
    ("fsdp2-full dp2", 3, {"dp_shard": 2}),
    ("fsdp2-full dp4", 3, {"dp_shard": 4}),
    ("tp2", 3, {"tp": 2}),
    ("dp2xtp2", 3, {"dp_shard": 2, "tp": 2}),
    ("pp2", 3, {"pp": 2}),
    ("pp2xdp2", 3, {"pp": 2, "dp_shard": 2}),
]


def make_layout(zero: int, degrees: dict):
    from raytrain_dt.topology.layout import Layout
    from raytrain_dt.topology.parallel_dims import ParallelDims

    world = 1
    for v in degrees.values():
        world *= v
    dims = ParallelDims(world_size=world, **degrees)
    return Layout(
        dims=dims,
        zero_stage=zero,
        micro_batch=GLOBAL_BATCH // (GRAD_ACCUM * dims.dp),
        grad_accum=GRAD_ACCUM,
    )


def make_config():
    from raytrain_dt.config import load_config

    return load_config(
        REPO / "conf" / "test.yaml",
        [
            f"model.preset={PRESET}",
            f"data.seq_len={SEQ_LEN}",
            f"trainer.global_batch={GLOBAL_BATCH}",
        ],
    )


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(t) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def _fsdp_params(model):
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                yield from group.fsdp_params


def _accumulating_grad_bytes(model) -> int:
    """Gradient bytes held between micro-batches: p.grad plus FSDP2's unsharded buffers."""
    total = sum(_nbytes(p.grad) for p in model.parameters() if p.grad is not None)
    for fp in _fsdp_params(model):
        unsharded = getattr(fp, "_unsharded_param", None)
        if unsharded is not None and unsharded.grad is not None:
            total += _nbytes(unsharded.grad)
        if getattr(fp, "unsharded_accumulated_grad", None) is not None:
            total += _nbytes(fp.unsharded_accumulated_grad)
    return total


def _held_param_bytes(model) -> int:
    """Parameter bytes held now: the local shards plus every FSDP2 all-gathered (unsharded) one."""
    total = sum(_nbytes(p) for p in model.parameters())
    for fp in _fsdp_params(model):
        if fp.sharded_state.name == "UNSHARDED":
            total += _nbytes(fp._unsharded_param)
    return total


def _measure_rank(rank: int, zero: int, degrees: dict, port: int) -> dict:
    import torch
    import torch.distributed as dist

    from raytrain_dt.control.run_setup import model_shape
    from raytrain_dt.engines.factory import build_engine
    from raytrain_dt.models.llama import build_model
    from raytrain_dt.worker.device import select_device

    cfg, layout = make_config(), make_layout(zero, degrees)
    dims = layout.dims
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=dims.world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        mesh = dims.build_mesh("cpu")
        model = build_model(model_shape(cfg), cfg.data.seq_len, cfg.run.seed)
        engine = build_engine(model, cfg, layout, mesh, select_device("fp32"))
        out: dict = {"rank": rank, "accum_grads": None, "fwd_params": 0}

        def after_forward(module, inputs, output):
            out["fwd_params"] = max(out["fwd_params"], _held_param_bytes(engine.model))

        hooked = list(engine.model.layers.values())
        if engine.pipeline is None:
            hooked.append(engine.model)
        for module in hooked:
            module.register_forward_hook(after_forward)

        if engine.pipeline is None:
            sync = engine.model.set_requires_gradient_sync
            calls = []

            def sync_hook(flag, *args, **kwargs):
                if calls:  # micro-batch 0's backward is done, its grads are unsynced
                    held = _accumulating_grad_bytes(engine.model)
                    out["accum_grads"] = max(out["accum_grads"] or 0, held)
                calls.append(flag)
                return sync(flag, *args, **kwargs)

            engine.model.set_requires_gradient_sync = sync_hook

        zero_grad = engine.optimizer.zero_grad

        def measure_then_zero(*args, **kwargs):
            params = list(engine.model.parameters())
            out["params"] = sum(_nbytes(p) for p in params)
            out["grads"] = sum(_nbytes(p.grad) for p in params if p.grad is not None)
            out["optim"] = sum(
                _nbytes(v)
                for state in engine.optimizer.state.values()
                for v in state.values()
                if isinstance(v, torch.Tensor)
            )
            out["local_numel"] = sum(_local(p).numel() for p in params)
            return zero_grad(*args, **kwargs)

        engine.optimizer.zero_grad = measure_then_zero
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
        zero, degrees, port, world = job
        if rank >= world:
            conn.send(("idle", None))
            continue
        try:
            conn.send(("ok", _measure_rank(rank, zero, degrees, port)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def planner_bytes(shape, layout) -> tuple[float, float, float]:
    from raytrain_dt.topology.memory import model_state_bytes

    d = layout.dims
    return model_state_bytes(
        shape, tp=d.tp, pp=d.pp, shard=d.dp_shard, zero_stage=layout.zero_stage, precision="fp32"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "memory.json"))
    parser.add_argument("--only", nargs="*", help="layout names to run (default: all)")
    args = parser.parse_args()

    from raytrain_dt.control.run_setup import model_shape

    shape = model_shape(make_config())
    layouts = [c for c in LAYOUTS if not args.only or c[0] in args.only]
    size = max(make_layout(z, d).dims.world_size for _, z, d in layouts)
    ctx = mp.get_context("spawn")
    conns, procs = [], []
    for rank in range(size):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker_main, args=(rank, child), daemon=True)
        proc.start()
        conns.append(parent)
        procs.append(proc)

    results, failures = [], 0
    header = (
        f"{'layout':<18} {'zero':>4} {'params':>8} {'grads':>8} {'optim':>8} {'total':>8}  "
        f"{'plan p/g/o':>20} {'plan tot':>8} {'ratio':>6}  {'accum g':>8} {'fwd p':>8}"
    )
    print(f"{PRESET}: {shape.num_params / 1e6:.2f}M params, fp32, MB per rank (max over ranks)")
    print(header)
    try:
        for name, zero, degrees in layouts:
            layout = make_layout(zero, degrees)
            world = layout.dims.world_size
            job = (zero, degrees, _free_port(), world)
            for conn in conns:
                conn.send(job)
            replies = []
            for rank, conn in enumerate(conns):
                if not conn.poll(JOB_TIMEOUT_S):
                    raise TimeoutError(f"rank {rank} gave no answer for {name}")
                replies.append(conn.recv())
            errors = [body for kind, body in replies if kind == "error"]
            if errors:
                failures += 1
                print(f"{name:<18} FAILED\n{errors[0]}")
                results.append({"layout": name, "error": errors[0].strip().splitlines()[-1]})
                continue
            ranks = [body for kind, body in replies if kind == "ok"]
            measured = {k: max(r[k] for r in ranks) for k in ("params", "grads", "optim")}
            total = max(r["params"] + r["grads"] + r["optim"] for r in ranks)
            # The pipeline schedule runs its own micro-batches: no hook there (None).
            accum = max((r["accum_grads"] or 0 for r in ranks), default=0)
            accum = accum if any(r["accum_grads"] is not None for r in ranks) else None
            fwd_params = max(r["fwd_params"] for r in ranks)
            plan = planner_bytes(shape, layout)
            plan_total = sum(plan)
            ratio = total / plan_total
            ok = abs(ratio - 1.0) <= TOLERANCE
            failures += not ok
            row = {
                "layout": name,
                "dims": layout.dims.describe(),
                "zero_stage": zero,
                "world_size": world,
                "params_mb": round(measured["params"] / MB, 3),
                "grads_mb": round(measured["grads"] / MB, 3),
                "optim_mb": round(measured["optim"] / MB, 3),
                "total_mb": round(total / MB, 3),
                "plan_params_mb": round(plan[0] / MB, 3),
                "plan_grads_mb": round(plan[1] / MB, 3),
                "plan_optim_mb": round(plan[2] / MB, 3),
                "plan_total_mb": round(plan_total / MB, 3),
                "ratio": round(ratio, 4),
                "params_ratio": round(measured["params"] / plan[0], 4),
                "grads_ratio": round(measured["grads"] / plan[1], 4),
                "optim_ratio": round(measured["optim"] / plan[2], 4),
                "accum_grads_mb": None if accum is None else round(accum / MB, 3),
                "fwd_params_mb": round(fwd_params / MB, 3),
                "per_rank_total_mb": [
                    round((r["params"] + r["grads"] + r["optim"]) / MB, 3) for r in ranks
                ],
                "step_s": round(max(r["step_s"] for r in ranks), 3),
                "status": "PASS" if ok else "FAIL",
            }
            results.append(row)
            plan_pgo = f"{plan[0] / MB:.1f}/{plan[1] / MB:.1f}/{plan[2] / MB:.1f}"
            print(
                f"{name:<18} {zero:>4} {row['params_mb']:>8.2f} {row['grads_mb']:>8.2f} "
                f"{row['optim_mb']:>8.2f} {row['total_mb']:>8.2f}  {plan_pgo:>20} "
                f"{row['plan_total_mb']:>8.2f} {ratio:>6.3f}  {'n/a' if accum is None else f'{accum / MB:.2f}':>8} "
                f"{row['fwd_params_mb']:>8.2f}  "
                f"{row['status']}"
            )
    finally:
        for conn, proc in zip(conns, procs, strict=True):
            if proc.is_alive():
                with contextlib.suppress(OSError):
                    conn.send(None)
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "title": "Model-state memory per rank: FSDP2 engine vs planner",
        "command": "python bench/bench_memory.py",
        "target": f"measured params+grads+optimizer within {TOLERANCE:.0%} of model_state_bytes",
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
