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


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(t) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def _fsdp_groups(model):
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                yield group


def _fsdp_params(model):
    for group in _fsdp_groups(model):
        yield from group.fsdp_params


def _accumulating_grad_bytes(model) -> int:
    """Gradient bytes held between micro-batches: sharded `.grad`s plus FSDP2's unsharded ones.

    As for parameters, an unsharded parameter may stand in the module for its shard, so the
    FSDP params are asked for both and `model.parameters()` only for the others.
    """
    fsdp_params = list(_fsdp_params(model))
    managed = {id(fp.sharded_param) for fp in fsdp_params}
    managed |= {id(fp._unsharded_param) for fp in fsdp_params if hasattr(fp, "_unsharded_param")}
    total = sum(
        _nbytes(p.grad) for p in model.parameters() if p.grad is not None and id(p) not in managed
    )
    for fp in fsdp_params:
        if fp.sharded_param.grad is not None:
            total += _nbytes(fp.sharded_param.grad)
        unsharded = getattr(fp, "_unsharded_param", None)
        if unsharded is not None and unsharded.grad is not None:
            total += _nbytes(unsharded.grad)
        if getattr(fp, "unsharded_accumulated_grad", None) is not None:
            total += _nbytes(fp.unsharded_accumulated_grad)
    return total


def _held_param_bytes(model) -> int:
    """Parameter bytes held now: every local shard plus every all-gathered (unsharded) copy.

    While unsharded, FSDP2 registers the unsharded tensor on the module in place of the shard,
    so the shards are counted through the FSDP params, not `model.parameters()`.
    """
    fsdp_params = list(_fsdp_params(model))
    managed = {id(fp.sharded_param) for fp in fsdp_params}
    managed |= {id(fp._unsharded_param) for fp in fsdp_params if hasattr(fp, "_unsharded_param")}
    total = sum(_nbytes(p) for p in model.parameters() if id(p) not in managed)
    for fp in fsdp_params:
        total += _nbytes(fp.sharded_param)
        if fp.sharded_state.name == "UNSHARDED":
            total += _nbytes(fp._unsharded_param)
    # A prefetched block's all-gather has landed but is not unsharded (waited on) yet.
    for group in _fsdp_groups(model):
        pending = getattr(group, "_all_gather_result", None)
        if pending is not None and not group.is_unsharded:
            total += _nbytes(pending.all_gather_output)
    return total


def _noting(note, method):
    def noted(*args, **kwargs):
        note()
        return method(*args, **kwargs)

    return noted


def _watch_gradient_sync(owner, model, out: dict) -> None:
    sync = owner.set_requires_gradient_sync
    calls = []

    def sync_hook(flag, *args, **kwargs):
        if calls:
            held = _accumulating_grad_bytes(model())
            out["accum_grads"] = max(out["accum_grads"] or 0, held)
        calls.append(flag)
        return sync(flag, *args, **kwargs)

    owner.set_requires_gradient_sync = sync_hook


def _measure_rank(rank: int, engine_name: str, zero: int, degrees: dict, port: int) -> dict:
    import torch
    import torch.distributed as dist

    from raytrain_dt.control.run_setup import model_shape
    from raytrain_dt.engines.factory import build_engine
    from raytrain_dt.models.llama import build_model
    from raytrain_dt.worker.device import select_device

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
        mesh = dims.build_mesh("cpu")
        model = build_model(model_shape(cfg), cfg.data.seq_len, cfg.run.seed)
        engine = build_engine(model, cfg, layout, mesh, select_device("fp32"))
        out: dict = {"rank": rank, "accum_grads": None, "fwd_params": None}
        if engine_name == "deepspeed":
            _instrument_deepspeed(engine, out)
        else:
            _instrument_fsdp2(engine, out)
        gen = torch.Generator().manual_seed(1234 + dims.coords(rank).dp)
        rows = torch.randint(0, 256, (GLOBAL_BATCH // dims.dp, SEQ_LEN), generator=gen)
        start = time.perf_counter()
        engine.train_step(list(torch.split(rows, layout.micro_batch)), 0)
        out["step_s"] = time.perf_counter() - start
        dist.barrier()
        return out
    finally:
        dist.destroy_process_group()


def _instrument_fsdp2(engine, out: dict) -> None:
    """Counts held parameters around every block's forward and backward, gradients between
    micro-steps, and all three states right after the optimizer step."""
    import torch

    def note_params(*_):
        out["fwd_params"] = max(out["fwd_params"] or 0, _held_param_bytes(engine.model))

    def after_forward(module, inputs, output):
        note_params()

    def note_backward():
        # Before a block's reduce-scatter its own and the prefetched block are unsharded, and
        # so is its gradient.
        note_params()
        held = _accumulating_grad_bytes(engine.model)
        out["accum_grads"] = max(out["accum_grads"] or 0, held)

    for group in _fsdp_groups(engine.model):
        group.post_backward = _noting(note_backward, group.post_backward)

    hooked = list(engine.model.layers.values())
    if engine.pipeline is None:
        hooked.append(engine.model)
    for module in hooked:
        module.register_forward_hook(after_forward)

    # Every call after a micro-step's backward sees that micro-step's unsynced gradients
    # (the schedule itself switches sync off per stage under pipeline parallelism).
    owners = (
        [engine.model]
        if engine.pipeline is None
        else [stage.submod for stage in engine.pipeline.stages]
    )
    for owner in owners:
        _watch_gradient_sync(owner, lambda: engine.model, out)

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


def _instrument_deepspeed(engine, out: dict) -> None:
    """Counts every tensor storage DeepSpeed holds at its inner optimizer steps (one per param
    group; the max is kept) and after the first micro-step's backward (under a pipeline: before
    the accumulated gradients are reduced).

    Parameters are the module's (ZeRO-3: each rank's `ds_tensor` partition); the optimizer is
    the inner optimizer's state plus the fp32 master partitions (ZeRO keeps them in
    `single_partition_of_fp32_groups` or `fp32_partitioned_groups_flat`); gradients are every
    other tensor the ZeRO optimizer holds in its attributes (partitions, accumulators).
    """
    import torch

    ds = engine.engine
    zero_optimizer = ds.optimizer
    inner = getattr(zero_optimizer, "optimizer", zero_optimizer)

    def count() -> dict:
        seen: set[int] = set()

        def take(tensors) -> int:
            total = 0
            for t in tensors:
                if not isinstance(t, torch.Tensor) or t.numel() == 0:
                    continue
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
            return total

        module_params = list(ds.module.parameters())
        masters = [p for group in inner.param_groups for p in group["params"]]
        for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
            masters += list(getattr(zero_optimizer, name, []))
        state = [v for s in inner.state.values() for v in s.values()]
        return {
            "params": take(getattr(p, "ds_tensor", p) for p in module_params),
            "optim": take(state + masters),
            "grads": take(
                [p.grad for p in module_params + masters] + list(_tensors_in(vars(zero_optimizer)))
            ),
        }

    step = inner.step

    def measure_after_step(*args, **kwargs):
        result = step(*args, **kwargs)
        for key, value in count().items():
            out[key] = max(out.get(key, 0), value)
        return result

    inner.step = measure_after_step
    backward = ds.backward

    def measure_after_backward(*args, **kwargs):
        result = backward(*args, **kwargs)
        if not ds.is_gradient_accumulation_boundary():
            out["accum_grads"] = max(out["accum_grads"] or 0, count()["grads"])
        return result

    ds.backward = measure_after_backward
    if getattr(engine, "pipeline", None) is not None:
        # The schedule runs backward outside DeepSpeed; what it accumulated is held until
        # ZeRO-1 reduces it into the partitions.
        reduce = zero_optimizer.reduce_gradients

        def measure_before_reduce(*args, **kwargs):
            out["accum_grads"] = max(out["accum_grads"] or 0, count()["grads"])
            return reduce(*args, **kwargs)

        zero_optimizer.reduce_gradients = measure_before_reduce


def _tensors_in(value, depth: int = 0):
    """Tensors reachable through dicts, lists and tuples (not through other objects)."""
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 4 and isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item, depth + 1)
    elif depth < 4 and isinstance(value, list | tuple):
        for item in value:
            yield from _tensors_in(item, depth + 1)


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
