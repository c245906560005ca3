"""The rank actor: one per accelerator. Sets up a process group, an engine and its data for a
given `RankSpec`, trains in a thread, and answers health polls while it does.

Ray is used only at this boundary (the class is made remote by the coordinator); the train
step itself (`worker.train_loop`) makes no Ray calls. Joining a layout (`setup`'s build on the
torch thread) is `JoinsLayouts` (`worker/layout_join.py`). Leaving one (`teardown`, and the
release of a layout whose loop failed) is `LeavesLayouts` (`worker/layout_release.py`): it
destroys the process groups and frees the model so the same actor can join the next layout
without re-importing torch. This module keeps the actor's lifecycle, its loop's savers and
what the coordinator calls.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from raytrain_dt.accel.device import (
    accelerator_name,
    memory_usage,
)
from raytrain_dt.checkpoint.digests import verify_files
from raytrain_dt.checkpoint.memory_files import to_wire
from raytrain_dt.checkpoint.record import train_state_record
from raytrain_dt.checkpoint.store import CheckpointStore
from raytrain_dt.checkpoint.write_process import start_write_process
from raytrain_dt.data.input_pipeline import import_rank_pipeline_modules
from raytrain_dt.engines.optim import scheduled_lr
from raytrain_dt.observe.mfu import peak_flops_per_accelerator
from raytrain_dt.worker.checkpointing import RankCheckpointer
from raytrain_dt.worker.input_stream import InputStream
from raytrain_dt.worker.layout_join import JoinsLayouts
from raytrain_dt.worker.layout_release import (
    LeavesLayouts,
    abort_process_groups,
    find_layout_caches,
)
from raytrain_dt.worker.notices import NoticeBoard, route_sigterm
from raytrain_dt.worker.peer_copies import (
    COPY_GROUP,
    COPY_GROUP_THREADS,
    CopyKey,
    CopyStore,
    PeerCopier,
)
from raytrain_dt.worker.rendezvous import serve_store
from raytrain_dt.worker.reports import CONTROL_GROUP, RankStatus, TrainStateReport
from raytrain_dt.worker.spec import RankSpec
from raytrain_dt.worker.train_loop import LoopSpec, run_loop

log = logging.getLogger("raytrain_dt.rank")

# What `ray.remote` makes the actor class with: copies are held and read beside set-up, and
# polls and teardown are answered during a set-up (which may be waiting on a dead peer).
ACTOR_CONCURRENCY_GROUPS = {COPY_GROUP: COPY_GROUP_THREADS, CONTROL_GROUP: 1}


# torch's NCCL flight recorder (on unless `comm.trace_buffer=0`, `control/comm_env.py`) dumps a
# rank's last collectives on a timeout to this prefix plus the rank; torch reads it when it
# writes its first dump. Each actor points it at its run's logs, beside its own log
# (docs/troubleshooting.md), so that the actors' runtime_env names no run's files; a
# `comm.env` setting of it stands.
FLIGHT_RECORDER_FILE_ENV = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"
FLIGHT_RECORDER_FILE_PREFIX = "nccl_trace_rank_"


def import_lazy_torch_modules() -> None:
    """Import what torch imports on first use: the first DTensor (FSDP2's `fully_shard`)
    imports torch._dynamo (about 1 s of CPU; `torch/_compile.py`), a checkpoint load DCP's
    planners. Done when the actor starts, this is off the path of its first formation (a
    warmed actor's, after an arrival or as a replacement, then builds as fast as a
    survivor's). Likewise what its data pipeline imports at its first read. And finds
    DTensor's caches, which a teardown clears (`find_layout_caches`; the clearing after a
    failure is on the path that releases blocked peers). Then freezes the garbage collector's
    view of what was imported, and forks the checkpoint writer process."""
    import torch._dynamo
    import torch.distributed.checkpoint.state_dict
    import torch.distributed.fsdp  # noqa: F401

    import raytrain_dt.engines.fsdp2  # noqa: F401

    import_rank_pipeline_modules()
    find_layout_caches()

    # Everything imported so far (torch, Ray: ~350k objects) lives as long as the
    # process: move it out of the collector's sight. A teardown's full collection, which frees
    # the old layout's model and optimizer, then scans only what layouts created (0.6 s before,
    # about 0.2 s after, on a busy 2-core host; on the path of every re-formation).
    gc.freeze()
    # Forked now, while the process holds only its imports: the child shares (and keeps alive)
    # whatever memory the process holds at the fork (`checkpoint/write_process.py`).
    start_write_process()


class RankWorker(JoinsLayouts, LeavesLayouts):
    def __init__(self, run_dir: str, actor_index: int):
        self._init_at = time.time()
        route_sigterm()  # the constructor runs on the main thread, the methods do not
        self.run_dir = Path(run_dir)
        self.actor_index = actor_index
        self._log_handler: logging.Handler | None = None
        # Set by `comm.env`, or on the node: it stands.
        self._flight_recorder_file_given = FLIGHT_RECORDER_FILE_ENV in os.environ
        self.spec: RankSpec | None = None
        self.engine = None
        self.checkpointer: RankCheckpointer | None = None
        self._reports: queue.Queue = queue.Queue()
        self._polls = 0  # calls of `poll` so far (chaos: when a reply has been received)
        # One thread does all of this actor's torch work, layout after layout: set-up, the
        # train loop, teardown. DTensor caches each op's sharding per thread (torch's
        # `LocalLRUCache`), so a loop on a thread of its own would recompute them all in its
        # first step (seconds on CPU: every foreach op of the optimizer and the clipping);
        # here set-up's checkpoint load and warm-up have already filled them.
        self._torch_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="train")
        # Queued first, so it runs while the coordinator is still deciding what to do with us.
        self._torch_thread.submit(self._import_lazy_torch_modules)
        self._training: Future | None = None
        self._setting_up: Future | None = None  # this layout's `_build`, until it returns
        self._batches: InputStream | None = None  # this layout's input (`_build`)
        self._store = None  # the layout's TCPStore (rank 0 serves it), while in the layout
        self._served_store = None  # served for the next layout (`serve_layout_store`)
        self._torch_thread_id = 0  # its ident, for saying where it is stuck
        self._stop = threading.Event()
        self._error: str | None = None
        self._done = False
        self._released_at_failure = False  # the failed loop let its layout go (`teardown`)
        self.notices: NoticeBoard | None = None
        # In-memory copies this actor holds (its ranks' and its peers'): they outlive layouts.
        self.copies = CopyStore()
        self._copier: PeerCopier | None = None
        self._device = None  # this layout's DeviceSpec (set by `_build`)
        # Weak references to this layout's process groups (`_build`), then to the released
        # layout's, until its collection has freed them (`_free_old_layout`).
        self._layout_groups: list = []
        self._released_groups: list = []
        self._bind_to_run(self.run_dir, actor_index)

    def _bind_to_run(self, run_dir: Path, actor_index: int) -> None:
        """What this actor writes goes to the run's logs: its own log,
        `run_dir/logs/actor_<index>.log`, and its flight-recorder dumps."""
        logs = run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        if not self._flight_recorder_file_given:
            os.environ[FLIGHT_RECORDER_FILE_ENV] = str(logs / FLIGHT_RECORDER_FILE_PREFIX)
        handler = logging.FileHandler(logs / f"actor_{actor_index}.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root = logging.getLogger("raytrain_dt")
        if self._log_handler is not None:
            root.removeHandler(self._log_handler)
            self._log_handler.close()
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        self._log_handler = handler

    def rebind(self, run_dir: str, actor_index: int) -> dict:
        """Join another run of the same driver as its actor `actor_index` (a warm actor kept
        from a finished run: `RankGroup` and `cluster.keep_warm_s`). It was torn down when
        that run ended; here it forgets the run: its held in-memory copies (generations start
        again in every run), its reports, and where it writes (`_bind_to_run`).
        Returns `where()`, which also proves it alive."""
        if self.engine is not None:  # `teardown` releases it
            raise RuntimeError(f"actor {self.actor_index} is still in a layout; not rebound")
        self.run_dir, self.actor_index = Path(run_dir), actor_index
        self._bind_to_run(self.run_dir, actor_index)
        self.copies = CopyStore()
        self.spec = None
        self._reports = queue.Queue()
        self._polls = 0
        self._training = self._setting_up = None
        self._error, self._done = None, False
        self._stop.clear()
        log.info("actor %d: rebound to run %s", actor_index, run_dir)
        return self.where()

    def _import_lazy_torch_modules(self) -> None:
        started = time.perf_counter()
        import_lazy_torch_modules()
        log.info(
            "actor %d: torch's lazy modules imported in %.2fs (%.2fs after __init__)",
            self.actor_index,
            time.perf_counter() - started,
            time.time() - self._init_at,
        )

    def warmed(self) -> float:
        """Waits for the imports queued at start; returns the seconds since `__init__`."""
        return self._torch_thread.submit(time.time).result() - self._init_at

    # --- discovery ---------------------------------------------------------------------------
    def where(self) -> dict:
        import ray

        ctx = ray.get_runtime_context()
        return {
            "actor_index": self.actor_index,
            "init_at": self._init_at,  # when __init__ ran: the process is up, torch imported
            "node_id": ctx.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
        }

    # --- lifecycle ---------------------------------------------------------------------------
    def setup(self, spec: RankSpec) -> dict:
        """Join the process group, build the engine, load state, open the data (collective)."""
        self.spec = spec
        self._stop.clear()
        self._error, self._done = None, False
        self._reports = queue.Queue()
        if self.notices is None:
            import ray

            self.notices = NoticeBoard(ray.get_runtime_context().get_node_id())
        # While it trains, a SIGTERM is a preemption notice for its node, not a sudden death.
        self.notices.catch_sigterm(spec.cfg.elastic.sigterm_grace_s)
        self.notices.watch_spot(spec.cfg.elastic.spot_notice_url)
        self._setting_up = self._torch_thread.submit(self._build, spec)
        return self._setting_up.result()

    def start(self) -> None:
        spec = self.spec
        assert spec is not None, "setup() must run before start()"
        coords = spec.layout.dims.coords(spec.rank)
        loop = LoopSpec(
            start_step=spec.start_step,
            end_step=spec.end_step,
            consumed_samples=spec.data.consumed_samples,
            global_batch=spec.layout.global_batch,
            grad_accum=spec.layout.grad_accum,
            seq_len=spec.cfg.data.seq_len,
            checkpoint_every=spec.cfg.checkpoint.every_steps,
            report_metrics=spec.rank == 0,
            report_sample_ids=coords.tp == 0 and coords.pp == 0 and coords.cp == 0,
            model_flops_per_token=spec.shape.flops_per_token(spec.cfg.data.seq_len),
            peak_flops_per_rank=peak_flops_per_accelerator(
                accelerator_name(self._device), spec.cfg.cluster.peak_tflops
            ),
            world_size=spec.world_size,
        )
        self._training = self._torch_thread.submit(self._run, loop)

    def _run(self, loop: LoopSpec) -> None:
        self._torch_thread_id = threading.get_ident()
        failed = False
        try:
            run_loop(
                self.engine,
                self._batches,
                loop,
                self._reports.put,
                self._save,
                self._stop,
                self.checkpointer.agree_requested,
                self._chaos,
                measure_memory=lambda: memory_usage(self._device),
                copy_state=self._copy_state,
            )
            self.checkpointer.wait()  # the last save is written before the rank reports done
            self._done = True
        except BaseException:
            self._error = traceback.format_exc()
            log.error("rank %s failed:\n%s", self.spec.rank if self.spec else "?", self._error)
            # A peer may be blocked in a collective with this rank (gloo cannot be aborted from
            # the waiting side): aborting this side's groups now makes its wait raise (on NCCL,
            # and on gloo's default group, which the abort destroys; a gloo sub-group's
            # connections close only when this layout is collected, docs/design.md), and the
            # peer is kept as a survivor. Seen in a gate: a survivor of an HSDP layout, blocked
            # in a reduce-scatter with a rank whose all-reduce had failed on a lost node, was
            # still blocked 4 s later and was replaced.
            abort_process_groups()
            failed = True
        if failed:  # outside the handler: its traceback's frames hold the engine
            self._let_go_of_failed_layout()

    def _train_state(self, step: int, consumed: int) -> dict:
        next_lr = scheduled_lr(self.spec.cfg.trainer, step)
        return train_state_record(self.spec, step, consumed, self._tensor_shapes, next_lr)

    def _save(self, step: int, consumed: int) -> None:
        spec = self.spec
        if self.checkpointer.memory_only and self._copier is not None:
            # A planned resize: the state stays in host memory, on this actor and its peer's.
            record = self._train_state(step, consumed) if spec.rank == 0 else None
            self._copier.copy_now(step, record)
            # A periodic save, or the run's last step (the run may end at this very drain),
            # is written to storage as well: the run never ends on copies alone.
            every = spec.cfg.checkpoint.every_steps
            if not (every and step % every == 0) and step < spec.cfg.trainer.steps:
                return
        if spec.rank == 0:
            self._reports.put(TrainStateReport(step, self._train_state(step, consumed)))
        self.checkpointer.save(CheckpointStore(spec.checkpoint_root).step_uri(step), step)

    def _copy_state(self, step: int, consumed: int) -> None:
        every = self.spec.cfg.checkpoint.memory_every_steps
        if self._copier is None or step % every:
            return
        if not self.checkpointer.copy_free:  # a copy in flight somewhere: all ranks skip
            self._copier.skipped += 1
            return
        record = self._train_state(step, consumed) if self.spec.rank == 0 else None
        self._copier.copy(step, record)

    # --- in-memory copies held for peers (Ray's copy concurrency group: beside set-up) --------
    def hold_copy(self, key: CopyKey, wire: dict) -> None:
        self.copies.hold(key, wire)

    def read_copy(self, key: CopyKey) -> dict | None:
        copy = self.copies.get(tuple(key))
        return None if copy is None else to_wire(copy)

    def verify_checkpoint(self, uri: str, files: dict[str, dict]) -> list[str]:
        """Check this rank's share of a checkpoint's files (size and checksum) before any rank
        loads it; what is wrong, one line per file (empty: intact). The coordinator hands each
        rank a disjoint share and gathers the answers (`checkpoint/digests.py`)."""
        return verify_files(uri, files)

    def request_checkpoint(self, stop: bool = False) -> None:
        """Save at the next step boundary (all ranks agree on which one); with `stop`, end
        training right after that save (drain before a resize or preemption)."""
        self.checkpointer.request(stop)

    def request_checkpoint_and_stop(self, memory_only: bool = False) -> None:
        self.checkpointer.request(stop=True, memory_only=memory_only)

    def serve_layout_store(self) -> int:
        """Serve the next layout's rendezvous store, as its rank 0 (`rendezvous.serve_store`;
        its `setup` takes it): the port, for the peers' specs."""
        import ray

        self._served_store = serve_store(ray.util.get_node_ip_address())
        return self._served_store.port

    def poll(self) -> RankStatus:
        self._polls += 1
        reports = []
        while True:
            try:
                reports.append(self._reports.get_nowait())
            except queue.Empty:
                break
        state = "failed" if self._error else "done" if self._done else "running"
        return RankStatus(
            rank=self.spec.rank if self.spec else None,
            state=state,
            reports=reports,
            error=self._error,
            notice=self.notices.notice if self.notices else None,
        )

    def full_state_dict(self) -> dict:
        """Gathered parameters (collective; every rank must be asked). For tests and export."""
        return self._torch_thread.submit(self.engine.full_state_dict).result()
