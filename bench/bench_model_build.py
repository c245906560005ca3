"""Benchmark: host memory per rank to build a model, sharded materialization vs the whole model.

Each case builds a Llama-style decoder on 4 ranks (torch.multiprocessing, gloo, CPU, fp32)
with FSDP2 full sharding, the way rank actors do: a skeleton on the meta device, sharded, then
only the rank's shards materialized (`models.materialize`). Every rank measures its RSS when
idle (torch imported, nothing built), restarts its high-water mark (`reset_host_peak`) and
reports its peak RSS after the build and, for the smaller models, after one training step
(AdamW moments included); the max over ranks is recorded.

Beside it, what every rank paid before this path existed: the whole fp32 model constructed
and initialised on the host (measured in one process; the old path then sharded it, so this is
its lower bound) and the same times 4 ranks.

Cases: ~100M and ~400M parameters (the 400M one is tests/ray/test_model_memory.py's model), and
the llama-1b preset (1.24B), the largest preset whose build fits on this 24 GiB machine (the
next one, llama-7b, is 27 GB in fp32 even spread over 4 ranks), built but not trained (a
step's fp32 AdamW state would need 20 GB more).

The ranks run with the host allocator's huge pages, as rank actors do (`comm_env`'s
HOST_ALLOCATOR_ENV); the 400M model once more without them ("4 KB pages") times what they save
in a step, whose fresh unsharded buffers otherwise page-fault 4 KB at a time.

Prints one line per case and writes bench/results/model_build.json.
Run: python bench/bench_model_build.py [--only NAME ...]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import common

WORLD = 4
SEQ_LEN = 16
GB = 1e9
# name -> (model overrides, train one step)
CASES = {
    "100M": (
        {
            "dim": 768,
            "n_layers": 12,
            "n_heads": 12,
            "n_kv_heads": 12,
            "ffn_hidden": 2048,
            "vocab_size": 8192,
        },
        True,
    ),
    "400M": (
        {
            "dim": 1536,
            "n_layers": 14,
            "n_heads": 12,
            "n_kv_heads": 12,
            "ffn_hidden": 4096,
            "vocab_size": 8192,
        },
        True,
    ),
    "llama-1b": ({"preset": "llama-1b"}, False),
}
FOUR_KB_PAGES = "400M, 4 KB pages"  # the 400M case once more, without huge pages
CASES[FOUR_KB_PAGES] = CASES["400M"]


def make_config(model: dict):
    from raytrain_dt.config import load_config

    return load_config(
        common.REPO / "conf" / "test.yaml",
        [f"model.{k}={v}" for k, v in model.items()]
        + [f"data.seq_len={SEQ_LEN}", f"trainer.global_batch={WORLD}", "trainer.warmup_steps=0"],
    )


def _rank_main(rank: int, port: int, model: dict, train: bool, results) -> None:
    import torch
    import torch.distributed as dist

    from raytrain_dt.accel.device import host_memory, reset_host_peak, select_device
    from raytrain_dt.engines.base import EngineBuild
    from raytrain_dt.engines.factory import build_engine
    from raytrain_dt.models.model_spec import model_spec
    from raytrain_dt.parallel.device_mesh import build_mesh
    from raytrain_dt.topology.layout import Layout
    from raytrain_dt.topology.parallel_dims import ParallelDims
    from raytrain_dt.worker.rank_actor import import_lazy_torch_modules

    torch.set_num_threads(1)  # as inside the Ray actors
    cfg = make_config(model)
    # What the rank actor measures: idle (its lazy torch modules imported when it started),
    # then the peak from the build on.
    import_lazy_torch_modules()
    reset_host_peak()
    idle = host_memory()["host_rss_bytes"]
    started = time.perf_counter()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    layout = Layout(ParallelDims(world_size=WORLD, dp_shard=WORLD), 3, 1, 1)
    engine = build_engine(
        EngineBuild(
            model_spec(cfg), cfg, layout, build_mesh(layout.dims, "cpu"), select_device("fp32")
        )
    )
    built = host_memory()["host_rss_peak_bytes"]
    build_s = time.perf_counter() - started
    stepped = step_s = None
    if train:
        engine.warm_up()  # as the rank actor does before its first step
        tokens = torch.randint(0, 256, (1, SEQ_LEN))
        dist.barrier()
        started = time.perf_counter()
        engine.train_step([tokens], 0)
        step_s = time.perf_counter() - started
        stepped = host_memory()["host_rss_peak_bytes"]
    dist.barrier()
    results.put((rank, idle, built, stepped, build_s, step_s))
    dist.destroy_process_group()


def _whole_model(model: dict, results) -> None:
    """The old path's first act on every rank: the whole fp32 model constructed on the host
    and initialised in place (torch's module init, as the old one did)."""
    import torch

    from raytrain_dt.accel.device import host_memory, reset_host_peak
    from raytrain_dt.models.model_spec import model_spec

    torch.set_num_threads(1)
    cfg = make_config(model)
    spec = model_spec(cfg)
    reset_host_peak()
    idle = host_memory()["host_rss_bytes"]
    with torch.device("cpu"):
        spec.instantiate(SEQ_LEN)
    results.put(host_memory()["host_rss_peak_bytes"] - idle)


def _spawn(target, args_per_process: list[tuple]) -> list:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, results)) for args in args_per_process]
    for proc in procs:
        proc.start()
    out = [results.get(timeout=1200) for _ in procs]
    for proc in procs:
        proc.join()
    return out


def bench_case(name: str) -> dict:
    from raytrain_dt.control.comm_env import HOST_ALLOCATOR_ENV
    from raytrain_dt.control.run_setup import model_shape

    model, train = CASES[name]
    params = model_shape(make_config(model)).num_params
    full = 4 * params
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # The spawned ranks' environment: torch reads it at a process's first allocation.
    pages = {variable: "0" for variable in HOST_ALLOCATOR_ENV} if name == FOUR_KB_PAGES else {}
    saved = dict(os.environ)
    os.environ.update({**HOST_ALLOCATOR_ENV, **pages})
    try:
        ranks = _spawn(_rank_main, [(r, port, model, train) for r in range(WORLD)])
    finally:
        os.environ.clear()
        os.environ.update(saved)
    build = max(built - idle for _, idle, built, _, _, _ in ranks)
    step = max(stepped - idle for _, idle, _, stepped, _, _ in ranks) if train else None
    (whole,) = _spawn(_whole_model, [(model,)])
    row = {
        "model": name,
        "params_m": round(params / 1e6, 1),
        "fp32_model_gb": round(full / GB, 3),
        "ranks": WORLD,
        "build_rss_above_idle_gb": round(build / GB, 3),
        "build_over_model": round(build / full, 3),
        "step_rss_above_idle_gb": "not trained" if step is None else round(step / GB, 3),
        "idle_rss_gb": round(max(r[1] for r in ranks) / GB, 3),
        "build_s": round(max(r[4] for r in ranks), 1),
        "host_pages": "4 KB" if pages else "huge (2 MB)",
        "step_s": "not trained" if step is None else round(max(r[5] for r in ranks), 1),
        "old_whole_model_rss_above_idle_gb": round(whole / GB, 3),
        "old_4_ranks_total_gb": round(WORLD * whole / GB, 2),
        "status": "PASS" if build < full / 2 else "FAIL",
    }
    print(
        f"{name}: {params / 1e6:.0f}M params ({full / GB:.2f} GB fp32): build +{build / GB:.3f} "
        f"GB per rank ({build / full:.2f}x the model)"
        + ("" if step is None else f", after a step +{step / GB:.3f} GB in {row['step_s']} s")
        + f"; the whole model in one process +{whole / GB:.3f} GB  {row['status']}"
    )
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=list(CASES), help="cases (default: all)")
    args = parser.parse_args()
    cases = [bench_case(name) for name in args.only or CASES]
    common.write_result(
        "model_build",
        "Model build: host RSS per rank, sharded materialization vs the whole model",
        "python bench/bench_model_build.py",
        "per rank, peak RSS after the build minus the idle actor's RSS below half the fp32 model "
        "(4 ranks, FSDP2 full sharding)",
        cases,
        notes=f"{WORLD} ranks (torch.multiprocessing, gloo, CPU, fp32, 1 thread each), seq_len "
        f"{SEQ_LEN}; max over ranks; step_*: after one step (AdamW moments and the foreach "
        "optimizer's temporaries included); step_s: that step's time, after the engine's "
        "warm-up. old_*: the whole fp32 model constructed and "
        "initialised in one process, which every rank did before sharding until sharded "
        "materialization. llama-1b is the largest preset whose build fits on this 24 GiB "
        "machine (llama-7b is 27 GB in fp32 even over 4 ranks); the old path would have "
        "needed old_4_ranks_total_gb for it; it is built, not trained (its fp32 AdamW state "
        f"would need 20 GB more); load average {common.load_average():.1f} at the end",
    )
    return 0 if all(c["status"] == "PASS" for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
