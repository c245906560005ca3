"""(d) of bench_checkpoint.py: the GIL a background checkpoint write takes from the training
thread, with each writer (`checkpoint.async_writer`: DCP's thread in the rank, or the rank's
writer process).

On a GPU host the training thread spends its step launching kernels, in Python: every moment
another thread of its process holds the GIL is a moment no kernel is launched, whatever the
host's free cores. On CPU the step's own compute hides that (its kernels release the GIL), so
it is measured apart: one rank (gloo, world 1) holds bench_checkpoint's model and optimizer
state; its main thread, standing in for a launch-bound training thread, runs a pure-Python loop
while an async save writes, and what its chunks of work take beyond their usual time (measured
just before) says how many of the write's seconds it could not run. On this host's 2 cores
that also counts plain CPU contention (the loop, the staging copy, the writer and DCP's thread
share them), so beside it: the CPU seconds of the rank's other threads during the write (the
save's; a thread holds the GIL only while it runs, so this bounds the GIL it took) and those
of the writer process (whose GIL is its own). Target: none of its own; GPU hosts' async
overhead (bench_gpu_state.py) is where it shows.

The figures move from run to run on this VM (1.1-2.7 s of CPU for the same write on a quiet
host): the loop's usual chunk time is measured just before each write, and each write is
repeated.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import statistics
import time
from pathlib import Path

GIL_TABLE = (
    "The GIL an async checkpoint write takes from the training thread: a pure-Python loop in "
    "the rank's main thread (a GPU host's launch-bound training thread) while one rank's "
    "state is written in the background; the seconds of the write it could not run, against "
    "what its chunks of work took beyond their usual time, and the CPU the save took in the "
    "rank (the most GIL it held) and in its writer process (median of the repeats; this "
    "host's 2 cores)"
)
PROBE_CHUNK = 2_000  # loop iterations between clock reads


def rank_engine(
    shape: dict,
    seq_len: int,
    world: int,
    rank: int = 0,
    port: int | None = None,
    writer: str = "process",
):
    """bench_checkpoint's rank: its process group (gloo, one intra-op thread, as in the Ray
    actors), the FSDP2 engine over `world` ranks (ZeRO-3) with its AdamW moments created by one
    step, and its device. `writer`: `checkpoint.async_writer` (the process is forked first, as
    a rank actor forks it at its start)."""
    import torch
    import torch.distributed as dist

    from raytrain_dt.accel.device import select_device
    from raytrain_dt.checkpoint.write_process import start_write_process
    from raytrain_dt.config.schema import TrainConfig
    from raytrain_dt.engines.base import EngineBuild
    from raytrain_dt.engines.fsdp2 import FSDP2Engine
    from raytrain_dt.models.model_spec import llama_spec
    from raytrain_dt.models.presets import ModelShape
    from raytrain_dt.parallel.device_mesh import build_mesh
    from raytrain_dt.topology.layout import Layout
    from raytrain_dt.topology.parallel_dims import ParallelDims

    torch.set_num_threads(1)
    if writer == "process":
        start_write_process()
    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    device = select_device("fp32")
    layout = Layout(ParallelDims(world_size=world, dp_shard=world), 3, 1, 1)
    mesh = build_mesh(layout.dims, device.device_type)
    cfg = TrainConfig()
    cfg = dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, seq_len=seq_len),
        checkpoint=dataclasses.replace(cfg.checkpoint, async_writer=writer),
    )
    engine = FSDP2Engine(EngineBuild(llama_spec(ModelShape(**shape)), cfg, layout, mesh, device))
    return engine, device


def _chunk_seconds(seconds: float) -> float:
    """The loop's usual time per chunk with nothing else running in the process: the median
    chunk over `seconds`."""
    chunks, started = [], time.perf_counter()
    while time.perf_counter() - started < seconds:
        at = time.perf_counter()
        for _ in range(PROBE_CHUNK):
            pass
        chunks.append(time.perf_counter() - at)
    return statistics.median(chunks)


def _children_cpu_s() -> float:
    """CPU seconds used so far by this process's children (the writer process)."""
    import psutil

    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def _write_while_probing(engine, group, uri: str) -> tuple[float, float, float, float]:
    """One async save to `uri` (its write's collectives on `group`), the probe running until
    its write is done: (the write's seconds; the seconds of it the probe could not run: what
    its chunks took beyond their usual time, measured just before; the CPU seconds of every
    other thread of the rank's process meanwhile: the most GIL the save can have held; and
    those of its writer process)."""
    from raytrain_dt.checkpoint.digests import FileDigests

    usual = _chunk_seconds(0.5)
    started, cpu, probe_cpu = time.perf_counter(), time.process_time(), time.thread_time()
    children_cpu = _children_cpu_s()
    future = engine.save_async(uri, group, digests=FileDigests())  # as the ranks write: digested
    stalled = 0.0
    while not future.done():
        at = time.perf_counter()
        for _ in range(PROBE_CHUNK):
            pass
        stalled += max(0.0, time.perf_counter() - at - usual)
    future.result()
    rank_cpu = (time.process_time() - cpu) - (time.thread_time() - probe_cpu)
    writer_cpu = _children_cpu_s() - children_cpu
    return time.perf_counter() - started, stalled, rank_cpu, writer_cpu


def _measure(scratch: str, shape: dict, seq_len: int, repeats: int, writer: str, results) -> None:
    import torch
    import torch.distributed as dist

    from raytrain_dt.worker.checkpointing import side_groups

    engine, _ = rank_engine(shape, seq_len, world=1, writer=writer)
    tokens = torch.randint(0, shape["vocab_size"], (1, seq_len))
    steps = iter(range(1_000_000))
    engine.train_step([tokens], next(steps))  # creates the AdamW moments
    write_group, _ = side_groups()
    # Untimed: the first async save allocates the staging buffers and caches the plans.
    _write_while_probing(engine, write_group, f"{scratch}/first")
    runs = []
    for i in range(repeats):
        # A step between saves, untimed, as in training (its optimizer takes the staged copy's
        # completion: `FSDP2Engine._hold_optimizer_until`).
        engine.train_step([tokens], next(steps))
        runs.append(_write_while_probing(engine, write_group, f"{scratch}/save_{i}"))
    size = sum(f.stat().st_size for f in Path(scratch, "save_0").rglob("*") if f.is_file())
    results.put((size, runs))
    dist.destroy_process_group()


# `checkpoint.async_writer`: each row's writer, and what the row is called.
WRITERS = {
    "thread": "async save of one rank's state, written by DCP's thread in the rank",
    "process": "async save of one rank's state, written by the rank's writer process (default)",
}


def bench_write_gil(scratch: Path, shape: dict, seq_len: int, repeats: int) -> list[dict]:
    """(d): the write as the ranks make it, `repeats` times, with each writer in turn."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    rows = []
    for writer, case in WRITERS.items():
        results = ctx.Queue()
        proc = ctx.Process(
            target=_measure,
            args=(str(scratch / writer), shape, seq_len, repeats, writer, results),
        )
        proc.start()
        size, runs = results.get(timeout=1800)
        proc.join()
        write_s, held_s, rank_cpu_s, writer_cpu_s = (
            statistics.median(r[i] for r in runs) for i in range(4)
        )
        print(
            f"write GIL ({writer}): {size / 1e6:.0f} MB written in {write_s:.2f} s, of which "
            f"the training thread could not run {held_s:.2f} s ({held_s / write_s:.0%}); the "
            f"save used {rank_cpu_s:.2f} s of the rank's CPU (the most GIL it held) and "
            f"{writer_cpu_s:.2f} s of its writer process's"
        )
        rows.append(
            {
                "case": case,
                "state_bytes": size,
                "repeats": repeats,
                "write_s": round(write_s, 3),
                "gil_taken_s": round(held_s, 3),
                "gil_taken_share_of_write": f"{held_s / write_s:.0%}",
                "rank_save_cpu_s": round(rank_cpu_s, 3),
                "writer_process_cpu_s": round(writer_cpu_s, 3),
                "per_repeat (write/gil taken/rank cpu/writer cpu)": " ".join(
                    "/".join(f"{v:.2f}" for v in run) for run in runs
                ),
            }
        )
    return rows
