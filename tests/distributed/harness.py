"""A persistent pool of rank processes that trains one layout after another, no Ray.

Starting a process and importing torch costs seconds on a 2-core machine, so the pool starts its
workers once (forked from a server that has imported torch: `rank_process_context`) and each
layout only pays for a process group: every job initialises a fresh gloo
group over the ranks it needs (the others sit it out), trains, and destroys the group. Ranks
read the same global batches as `tests/reference.py`, cut per DP rank exactly as
`raytrain_dt.data.input_pipeline` cuts them (uneven slices plus padding when dp does not divide it). A wedged collective fails within the process-group
timeout and a wedged worker within `JOB_TIMEOUT_S`, so a broken layout never hangs the suite.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import pickle
import traceback
from dataclasses import dataclass, field

PG_TIMEOUT_S = 60
JOB_TIMEOUT_S = 180
# What every rank process imports before its first job: torch, what torch imports on first use
# (torch._dynamo, at FSDP2's first DTensor), DCP and the FSDP2 engine, and what its first read
# of the token dataset imports (`pq.read_table` imports pyarrow.dataset, and with it pandas:
# about 2.3 CPU-s a rank, measured with py-spy). About 7 CPU-s a process here; forked from a
# server that imported them once, a rank starts in a fraction of a second.
RANK_PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint.state_dict",
    "raytrain_dt.engines.fsdp2",
    "raytrain_dt.data.source",
    "pyarrow.dataset",
]


def rank_process_context():
    """The multiprocessing context these tests start rank processes from: a fork server that
    has imported `RANK_PRELOAD` (started at the first rank of this pytest process, and shared
    by all). Forking after torch's import is safe where no thread pool has started yet, which
    importing does not; each rank then sets itself up (`settle_rank_process`)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_PRELOAD)
    return ctx


# The CPU priority Ray gives the workers it starts (its `worker_niceness`), our rank actors too.
RAY_WORKER_NICENESS = 15


def settle_rank_process() -> None:
    """What every rank process these tests spawn does first. One thread each: several ranks
    share two cores, and more would only thrash. Ray's priority for workers: the other
    pytest-xdist worker trains Ray ranks, which run at nice 15, and Linux gives a nice-0 process
    about 28 times their CPU share. Spawned ranks at nice 0 starved them: a CI run formed four
    Ray ranks in 131 s instead of 10 and a test ran past its timeout."""
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    current = os.getpriority(os.PRIO_PROCESS, 0)
    os.setpriority(os.PRIO_PROCESS, 0, max(current, RAY_WORKER_NICENESS))


def join_served_group(
    rank: int, world: int, port: int, timeout_s: float, backend: str = "gloo", prefix: str = ""
) -> None:
    """Form the process group of `world` spawned ranks on the store that their test process
    serves at `port` (`rendezvous.serve_store`, held for the ranks' life), under `prefix`. The
    OS picked that port as the server bound it, so nothing can have taken it since (a port
    found free and bound later by rank 0 was, at times, taken meanwhile by the other xdist
    worker's Ray: EADDRINUSE)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(prefix, store) if prefix else store,
        rank=rank,
        world_size=world,
        timeout=timeout,
    )


@dataclass(frozen=True)
class Job:
    cfg: object  # TrainConfig
    layout: object  # Layout
    steps: int
    # The pool's rendezvous store (`WorkerPool._store`), and this job's key prefix in it.
    store_port: int
    store_prefix: str
    # Load this DCP checkpoint before training, and train steps [start_step, start_step+steps).
    load_dir: str | None = None
    start_step: int = 0
    # Save a DCP checkpoint here after training (collective) and return its state-dict keys.
    checkpoint_dir: str | None = None
    # engine.precision for `select_device` ("bf16" runs FSDP2's MixedPrecisionPolicy on CPU).
    precision: str = "fp32"
    # cluster.device: "cpu" (gloo), "emulated" (the emu device and its NCCL-like backend) or
    # "cuda" (NCCL, on GPU machines).
    device: str = "cpu"
    # After `async_save_after` steps, start the engine's async save (pinned staging) into
    # `async_save_dir`; it is written while the remaining steps train.
    async_save_dir: str | None = None
    async_save_after: int = 0
    # Fault injection: the step's loss reduced from a host tensor, as the engines once did (a
    # GPU collective must refuse it).
    host_loss: bool = False
    # model.init_from: the initial weights' Hugging Face directory (each rank reads its slices).
    init_from: str | None = None
    # After training, each rank takes its in-memory copy (`worker/peer_copies.py`'s staging and
    # `checkpoint/memory_files.py`) and leaves it in `<memory_copy_dir>/<rank>.copy`.
    memory_copy_dir: str | None = None
    # Load the in-memory copies of `load_copies_of` ranks left in this directory (as a rank
    # reads them from the actors holding them) instead of `load_dir`.
    load_copies_dir: str | None = None
    load_copies_of: int = 0


@dataclass
class JobResult:
    losses: list[float]
    params: dict = field(default_factory=dict)
    checkpoint_keys: list[str] | None = None
    # With an async save: whether the staging buffers of the model's shards were pinned.
    staged_pinned: bool | None = None
    # The device type the engine's parameters lived on.
    param_device: str | None = None
    # With an async save: the bytes of all its staging buffers (model and optimizer states).
    staged_bytes: int | None = None
    # Each step's `StepResult.router` (mixture-of-experts models; None for dense ones).
    router: list = field(default_factory=list)


def _run_job(rank: int, job: Job) -> JobResult:
    import torch
    import torch.distributed as dist

    from raytrain_dt.accel.device import select_device
    from raytrain_dt.data.order import rank_rows, sample_ids
    from raytrain_dt.data.source import TokenDataset
    from raytrain_dt.engines.base import EngineBuild
    from raytrain_dt.engines.factory import build_engine
    from raytrain_dt.models.materialize import initial_weights
    from raytrain_dt.models.model_spec import model_spec
    from raytrain_dt.parallel.device_mesh import build_mesh

    cfg, layout = job.cfg, job.layout
    dims = layout.dims
    # One accelerator per rank, as on a GPU node (the emulated device has eight, all host RAM).
    device = select_device(job.precision, job.device, index=rank)
    device.activate()
    join_served_group(
        rank, dims.world_size, job.store_port, PG_TIMEOUT_S, device.backend, job.store_prefix
    )
    try:
        mesh = build_mesh(dims, device.device_type)
        spec = model_spec(cfg)  # our preset, or `model.hf`
        weights = initial_weights(spec, cfg.run.seed, job.init_from)
        engine = build_engine(EngineBuild(spec, cfg, layout, mesh, device, weights))
        if job.host_loss:  # the engines' old bug: the step's loss summed in a host tensor
            micro_steps = engine._micro_steps
            engine._micro_steps = lambda *args: micro_steps(*args).cpu()
        if job.load_dir:
            engine.load(job.load_dir)
        if job.load_copies_dir:
            engine.load("memory://harness", storage_reader=_copy_reader(job))
        dataset = TokenDataset.open(cfg.data.path, cfg.data.seq_len)
        dp_rank = dims.coords(rank).dp
        g = layout.global_batch
        losses, router = [], []
        saving = None
        for step in range(job.start_step, job.start_step + job.steps):
            if job.async_save_dir and step == job.start_step + job.async_save_after:
                saving = engine.save_async(job.async_save_dir, dist.new_group(backend="gloo"))
            # A padded layout's ranks read uneven slices; `real` marks their padding rows.
            slots = layout.micro_batch * layout.grad_accum
            positions, real = rank_rows(step * g, 1, g, dims.dp, dp_rank, slots)
            ids = sample_ids(positions, dataset.num_samples, cfg.data.shuffle_seed)
            rows = torch.from_numpy(dataset.read(ids))
            micro = list(torch.split(rows, layout.micro_batch))
            masks = list(torch.split(torch.from_numpy(real), layout.micro_batch))
            assert len(micro) == layout.grad_accum, (len(micro), layout)
            result = engine.train_step(micro, step, masks)
            losses.append(result.loss)
            router.append(result.router)
        staged_pinned = staged_bytes = None
        if saving is not None:
            saving.result()
            # The model's shards all live on the compute device (the optimizer's step counts
            # stay on the host, and so do their buffers).
            buffers = _tensors(engine._stager._staged["model"])
            staged_pinned = bool(buffers) and all(b.is_pinned() for b in buffers)
            staged_bytes = sum(
                t.numel() * t.element_size() for t in _tensors(engine._stager._staged)
            )
        module = engine.model if hasattr(engine, "model") else engine.engine.module  # DeepSpeed
        param_device = next(module.parameters()).device.type
        params = engine.full_state_dict()
        if job.memory_copy_dir:
            _leave_memory_copy(engine, job.memory_copy_dir, rank)
        keys = None
        if job.checkpoint_dir:
            engine.save(job.checkpoint_dir)
            dist.barrier()
            keys = _checkpoint_keys(job.checkpoint_dir)
        del engine
        return JobResult(
            losses,
            params if rank == 0 else {},
            keys,
            staged_pinned,
            param_device,
            staged_bytes,
            router,
        )
    finally:
        dist.destroy_process_group()


def _leave_memory_copy(engine, directory: str, rank: int) -> None:
    from raytrain_dt.checkpoint.memory_files import capture_copy, copy_metadata, to_wire
    from raytrain_dt.checkpoint.staging import ReusableStager

    staged = engine.stage_copy(ReusableStager(background=True)).result()
    copy = capture_copy(staged, rank, b"", copy_metadata(staged, rank))
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"{rank}.copy"), "wb") as f:
        pickle.dump(to_wire(copy), f, protocol=5)  # as Ray sends it to a peer


def _copy_reader(job: Job):
    from raytrain_dt.checkpoint.memory_files import CopyReader, from_wire

    def fetch(owner: int):
        with open(os.path.join(job.load_copies_dir, f"{owner}.copy"), "rb") as f:
            return from_wire(pickle.load(f))

    return CopyReader(list(range(job.load_copies_of)), fetch)


def _tensors(tree) -> list:
    """Every tensor's local part in a nested state dict."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, dict):
        return [t for value in tree.values() for t in _tensors(value)]
    if isinstance(tree, (list, tuple)):
        return [t for value in tree for t in _tensors(value)]
    if isinstance(tree, DTensor):
        return [tree.to_local()]
    return [tree] if hasattr(tree, "is_pinned") else []


def _checkpoint_keys(path: str) -> list[str] | None:
    """The state-dict keys of a DCP checkpoint; None for DeepSpeed's own format."""
    import torch.distributed.checkpoint as dcp

    if not os.path.exists(os.path.join(path, ".metadata")):
        return None
    metadata = dcp.FileSystemReader(path).read_metadata()
    return sorted(metadata.state_dict_metadata)


def _worker_main(rank: int, conn) -> None:
    settle_rank_process()
    while True:
        job = conn.recv()
        if job is None:
            return
        if rank >= job.layout.dims.world_size:
            conn.send(("idle", None))
            continue
        try:
            conn.send(("ok", _run_job(rank, job)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


class WorkerPool:
    """`size` rank processes; `run(cfg, layout, steps)` trains on the first world_size."""

    def __init__(self, size: int = 4):
        from raytrain_dt.worker.rendezvous import serve_store

        ctx = rank_process_context()
        # The jobs' rendezvous store, served from this process for the pool's life
        # (`join_served_group`); each job rendezvouses under its own prefix.
        self._store = serve_store("127.0.0.1")
        self._jobs = 0
        self._conns = []
        self._procs = []
        for rank in range(size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(rank, child), daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)

    def run(self, cfg, layout, steps: int, **options) -> JobResult:
        """Train `layout` for `steps` steps; options are Job's load/save fields."""
        if layout.dims.world_size > len(self._procs):
            raise ValueError(f"layout needs {layout.dims.world_size} ranks, pool has fewer")
        self._jobs += 1
        job = Job(cfg, layout, steps, self._store.port, f"job{self._jobs}/", **options)
        for conn in self._conns:
            conn.send(job)
        replies = []
        for rank, conn in enumerate(self._conns):
            if not conn.poll(JOB_TIMEOUT_S):
                self.close(force=True)
                raise TimeoutError(f"rank {rank} gave no answer in {JOB_TIMEOUT_S}s ({layout})")
            replies.append(conn.recv())
        errors = [f"rank {r}:\n{body}" for r, (kind, body) in enumerate(replies) if kind == "error"]
        if errors:
            raise RuntimeError(f"{layout.describe()} failed\n" + "\n".join(errors))
        return replies[0][1]

    def close(self, force: bool = False) -> None:
        for conn, proc in zip(self._conns, self._procs, strict=True):
            if proc.is_alive() and not force:
                with contextlib.suppress(OSError):
                    conn.send(None)
        for proc in self._procs:
            proc.join(timeout=0 if force else 10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
