"""The rank actor: one per accelerator. Sets up a process group, an engine and its data for a
given `RankSpec`, trains in a thread, and answers health polls while it does.

Ray is used only at this boundary (the class is made remote by the coordinator); the train
step itself (`worker.train_loop`) makes no Ray calls. `teardown` destroys the process group and
frees the model so the same actor can join the next layout without re-importing torch.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import queue
import socket
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import torch.distributed as dist

from raytrain_dt.accel.device import (
    DeviceSpec,
    accelerator_name,
    host_memory,
    memory_usage,
    ray_accelerator_index,
    ray_device_kind,
    release_accelerator_memory,
    reset_host_peak,
    return_free_host_memory,
    select_device,
)
from raytrain_dt.checkpoint.digests import verify_files
from raytrain_dt.checkpoint.memory_files import to_wire
from raytrain_dt.checkpoint.record import tensor_shapes, train_state_record
from raytrain_dt.checkpoint.store import CheckpointStore
from raytrain_dt.data.input_pipeline import DataPlacement
from raytrain_dt.engines.base import EngineBuild
from raytrain_dt.engines.factory import build_engine
from raytrain_dt.engines.optim import scheduled_lr
from raytrain_dt.models.materialize import initial_weights
from raytrain_dt.models.model_spec import llama_spec
from raytrain_dt.observe.mfu import peak_flops_per_accelerator
from raytrain_dt.observe.phases import PhaseTimer
from raytrain_dt.worker.checkpointing import RankCheckpointer
from raytrain_dt.worker.input_stream import InputStream
from raytrain_dt.worker.layout_release import (
    abort_process_groups,
    forget_layout_caches,
    where_thread_is,
)
from raytrain_dt.worker.notices import NoticeBoard, route_sigterm
from raytrain_dt.worker.peer_copies import (
    COPY_GROUP,
    COPY_GROUP_THREADS,
    CopyKey,
    CopyStore,
    PeerCopier,
    load_from_copies,
)
from raytrain_dt.worker.rank_chaos import RankChaos
from raytrain_dt.worker.rendezvous import join_layout
from raytrain_dt.worker.reports import CONTROL_GROUP, RankStatus, TrainStateReport
from raytrain_dt.worker.spec import RankSpec
from raytrain_dt.worker.train_loop import LoopSpec, run_loop

log = logging.getLogger("raytrain_dt.rank")

# The least time an aborted collective may take to raise in the training thread and the
# thread to return before the actor is given up (the coordinator gives a step: `Deadlines.
# leave_bound`). A survivor given up takes its in-memory copies (its own and a peer's) with it,
# and a replacement costs a process start and a load: seconds; on a loaded host the abort
# alone takes over 0.2 s.
ABORTED_COLLECTIVE_GRACE_S = 2.0
# The same on gloo, whose abort releases no peer (`DeviceSpec.abort_releases_peers`): a
# collective blocked on a live peer whose own loop failed returns when that peer's old layout
# is collected after its teardown, which on a loaded host (CI's 2 cores, two runs) took over
# 2 s, and a healthy survivor was replaced. A collective blocked on a dead peer returns at
# once (its sockets closed with its process): only a stuck peer costs the whole grace.
GLOO_ABORTED_COLLECTIVE_GRACE_S = 10.0


def aborted_collective_grace_s(device: DeviceSpec | None) -> float:
    """The least time an aborted collective is given to return on this layout's device."""
    if device is not None and not device.abort_releases_peers:
        return GLOO_ABORTED_COLLECTIVE_GRACE_S
    return ABORTED_COLLECTIVE_GRACE_S


# What `ray.remote` makes the actor class with: copies are held and read beside set-up, and
# polls and teardown are answered during a set-up (which may be waiting on a dead peer).
ACTOR_CONCURRENCY_GROUPS = {COPY_GROUP: COPY_GROUP_THREADS, CONTROL_GROUP: 1}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def import_lazy_torch_modules() -> None:
    """Import what torch imports on first use: the first DTensor (FSDP2's `fully_shard`)
    imports torch._dynamo (about 1 s of CPU; `torch/_compile.py`), a checkpoint load DCP's
    planners. Done when the actor starts, this is off the path of its first formation (a
    warmed actor's, after an arrival or as a replacement, then builds as fast as a
    survivor's). Then freezes the garbage collector's view of what was imported."""
    import torch._dynamo
    import torch.distributed.checkpoint.state_dict
    import torch.distributed.fsdp  # noqa: F401

    import raytrain_dt.engines.fsdp2  # noqa: F401

    # Everything imported so far (torch, Ray: ~350k objects) lives as long as the
    # process: move it out of the collector's sight. A teardown's full collection, which frees
    # the old layout's model and optimizer, then scans only what layouts created (0.6 s before,
    # about 0.2 s after, on a busy 2-core host; on the path of every re-formation).
    gc.freeze()


class RankWorker:
    def __init__(self, run_dir: str, actor_index: int):
        self._init_at = time.time()
        route_sigterm()  # the constructor runs on the main thread, the methods do not
        self.run_dir = Path(run_dir)
        self.actor_index = actor_index
        self._log_handler: logging.Handler | None = None
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
        self._log_to(self.run_dir, actor_index)

    def _log_to(self, run_dir: Path, actor_index: int) -> None:
        """This actor's log: `run_dir/logs/actor_<index>.log`, the run's own."""
        logs = run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(logs / f"actor_{actor_index}.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root = logging.getLogger("raytrain_dt")
        if self._log_handler is not None:
            root.removeHandler(self._log_handler)
            self._log_handler.close()
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        self._log_handler = handler

    def rebind(self, run_dir: str, actor_index: int, run_env: dict[str, str]) -> dict:
        """Join another run of the same driver as its actor `actor_index` (a warm actor kept
        from a finished run: `RankGroup` and `cluster.keep_warm_s`). It was torn down when
        that run ended; here it forgets the run: its held in-memory copies (generations start
        again in every run), its reports and its log, and takes the new run's variables that
        name the run's files (`comm_env.RUN_SCOPED_ENV`, read when a process group forms).
        Returns `where()`, which also proves it alive."""
        if self.engine is not None:  # `teardown` releases it
            raise RuntimeError(f"actor {self.actor_index} is still in a layout; not rebound")
        self.run_dir, self.actor_index = Path(run_dir), actor_index
        self._log_to(self.run_dir, actor_index)
        os.environ.update(run_env)
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
            "port": free_port(),
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

    @staticmethod
    def _open_input(spec: RankSpec, start_at_once: bool) -> InputStream:
        return InputStream(
            spec.data,
            spec.cfg.data.prefetch_batches,
            DataPlacement.of_this_actor(spec.cfg.cluster.data_cpus_per_rank),
            start_at_once,
        )

    def _build(self, spec: RankSpec) -> dict:
        self._torch_thread_id = threading.get_ident()
        timings: dict[str, float] = {}
        # Host memory of the idle actor (torch imported), and the peak from here on: this
        # layout's own (a reused actor's earlier layouts do not count).
        reset_host_peak()
        idle_rss = host_memory()["host_rss_bytes"]
        run_start = not (spec.resume_from or spec.memory_resume)
        if run_start:
            # No recovery waits for this layout's first step: its pipeline starts now, and the
            # node's Ray Data workers start while the model builds (`input_stream`).
            self._batches = self._open_input(spec, start_at_once=True)
        t0 = time.perf_counter()
        # The accelerator Ray assigned this actor, not one guessed from the rank.
        device = select_device(
            spec.cfg.engine.precision,
            ray_device_kind(spec.cfg.cluster.device),
            ray_accelerator_index(),
        )
        device.activate()
        self._device = device
        joined = join_layout(spec, device.backend, device.device_type, self._stop)
        self._store, mesh = joined.store, joined.mesh
        timings["process_group_s"] = time.perf_counter() - t0

        t1 = time.perf_counter()
        model_spec = spec.model or llama_spec(spec.shape)
        # For the checkpoint record: the full model's shapes, from its structure alone.
        meta = model_spec.build(spec.cfg.data.seq_len, spec.cfg.run.seed, device="meta")
        self._tensor_shapes = tensor_shapes(meta.state_dict())
        resuming = spec.resume_from or spec.memory_resume
        init_from = None if resuming else spec.cfg.model.init_from  # a checkpoint wins
        weights = initial_weights(model_spec, spec.cfg.run.seed, init_from)
        # The engine materializes only this rank's shards (`models.materialize`).
        self.engine = build_engine(
            EngineBuild(model_spec, spec.cfg, spec.layout, mesh, device, weights)
        )
        self._chaos = RankChaos(
            spec.cfg.chaos,
            spec.rank,
            spec.cfg.chaos_step_delay_s,
            wait_for_save=lambda: self.checkpointer.wait(),
            reports=self._reports,
            polls=lambda: self._polls,
        )
        self.checkpointer = RankCheckpointer(
            self.engine,
            spec.rank,
            self._reports.put,
            spec.cfg.checkpoint.async_save,
            device,
            die_while_saving=self._chaos.die_while_saving(),
            groups=joined.checkpoint_groups,
        )
        timings["model_build_s"] = time.perf_counter() - t1
        # Reported in the `model_built` event (what building the model cost in host memory).
        peak_rss = host_memory()["host_rss_peak_bytes"]
        timings.update(host_rss_idle_bytes=idle_rss, host_rss_peak_bytes=peak_rss)
        self._copier = self._peer_copier(spec, device)
        if self._copier is not None:
            self.checkpointer.copy_busy = lambda: self._copier.busy
        t_load = time.perf_counter()
        if spec.memory_resume is not None:
            read = load_from_copies(
                self.engine,
                device,
                spec.rank,
                spec.memory_resume,
                self.copies,
                spec.actor_index,
                spec.resume_from,
            )
            timings.update(read)
        elif spec.resume_from:
            self.engine.load(spec.resume_from)
            self.checkpointer.restore_rng(spec.resume_from)
        timings["checkpoint_load_s"] = time.perf_counter() - t_load
        t_warm = time.perf_counter()
        self.engine.warm_up()  # the first step's one-time costs, paid here (see __init__)
        timings["warm_up_s"] = time.perf_counter() - t_warm

        t2 = time.perf_counter()
        if not run_start:
            # The first steps are read here while Ray Data's pipeline starts (`input_stream`).
            self._batches = self._open_input(spec, start_at_once=False)
        timings["data_start_s"] = time.perf_counter() - t2
        log.info(
            "rank %d/%d ready: %s (%s)",
            spec.rank,
            spec.world_size,
            spec.layout.describe(),
            json.dumps(timings),
        )
        return timings

    def _peer_copier(self, spec: RankSpec, device) -> PeerCopier | None:
        if not spec.cfg.checkpoint.memory_every_steps or not self.engine.supports_async_save:
            return None  # DeepSpeed writes its own files: it resumes from durable checkpoints
        log.info(
            "rank %d: in-memory copies every %d steps, held here and by actor %s",
            spec.rank,
            spec.cfg.checkpoint.memory_every_steps,
            spec.copy_peer.actor_index if spec.copy_peer else None,
        )
        return PeerCopier(
            self.engine,
            device,
            spec.rank,
            spec.generation,
            spec.actor_index,
            self.copies,
            spec.copy_peer,
            self._reports.put,
        )

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

    def _let_go_of_failed_layout(self) -> None:
        """A failed rank's layout is dead (its groups aborted), so it is released and collected
        now, not at the driver's teardown: a peer blocked with this rank in a gloo sub-group
        is released only when the group's last reference is gone, and the mesh holds its
        groups, while FSDP's state (in reference cycles) and every staged DTensor hold the
        mesh. In bench_elastic's rank death the blocked survivor failed 1.0 s after the dead
        rank, at the end of its peers' teardown; now at the end of their collection (0.2-0.4 s
        after on a quiet host, 0.6-0.8 s in the whole bench).

        Not while a save or an in-memory copy is in flight: it holds staged state (and so the
        mesh) itself, and its outcome must be reported before the coordinator picks what to
        resume from (`teardown` waits for it)."""
        copying = self._copier is not None and self._copier.busy
        saving = self.checkpointer is not None and not self.checkpointer.wait(0)
        if copying or saving:
            return
        started = time.perf_counter()
        self._release_layout()
        self._released_at_failure = True
        log.info(
            "rank %s let its failed layout go in %.3fs",
            self.spec.rank if self.spec else "?",
            time.perf_counter() - started,
        )
        # Next on this thread, after `_run` has returned: a teardown waiting for the loop to
        # end answers at once, and the driver re-plans meanwhile; the next set-up follows it.
        self._torch_thread.submit(self._free_old_layout)

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

    def free_port(self) -> int:
        return free_port()

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

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        if self._training is not None:
            wait([self._training], timeout=timeout_s)

    def teardown(
        self,
        grace_s: float = 2.0,
        keep_save: bool = True,
        return_s: float = ABORTED_COLLECTIVE_GRACE_S,
        save_grace_s: float = 5.0,
    ) -> bool:
        """Leave the current layout: end the loop (or a set-up still joining its peers), let a
        save in flight finish (for at most `save_grace_s`: its outcome stays queued for the
        coordinator's next poll, which decides whether that checkpoint commits; with
        `keep_save` False it is abandoned at once: the resume needs it not), free model
        and data, destroy the process group. The actor (and its imported torch) stays for the
        next layout. `return_s`: how long the torch thread may take to return once its
        communicators are aborted (the rest of its step: it raises at its next collective).
        Returns False when the torch thread is stuck (in a collective with a dead
        or hung peer): such an actor cannot be reused and the coordinator replaces it. An
        aborted collective is given at least `aborted_collective_grace_s` of this device.
        Runs in the control concurrency group, beside a set-up that may be waiting."""
        phases = PhaseTimer()
        self.stop(grace_s)  # `_stop` also ends a set-up's wait for its peers (`join_store`)
        phases.lap("loop")
        if self.checkpointer is not None and not keep_save:
            self.checkpointer.abandon()
        # A save runs in threads of its own, so it finishes even when the loop is stuck.
        if self.checkpointer is not None and not self.checkpointer.wait(save_grace_s):
            log.warning(
                "rank %s: a checkpoint save still in flight after %.0fs",
                self.spec.rank if self.spec else "?",
                save_grace_s,
            )
        phases.lap("save")
        if self._setting_up is not None and not self._setting_up.done():
            # Told to leave (`_stop`), a set-up still joining returns within a poll of its
            # join; the loop was given its grace by `stop`.
            wait([self._setting_up], timeout=grace_s)
        busy = [f for f in (self._training, self._setting_up) if f is not None and not f.done()]
        if busy:
            # Blocked in a collective with a dead or hung peer: abort the communicators (NCCL's
            # ncclCommAbort; the emulated backend's equivalent), which makes the collective
            # raise in the torch thread, as torchft does, and wait for the thread once more.
            where = where_thread_is(self._torch_thread_id)
            abort_process_groups()
            return_s = max(return_s, aborted_collective_grace_s(self._device))
            wait(busy, timeout=return_s)
            if any(not f.done() for f in busy):
                log.warning(
                    "rank %s: torch thread still busy %.1fs after aborting its "
                    "groups; not reusable. It is at:\n%s",
                    self.spec.rank if self.spec else "?",
                    return_s,
                    where,
                )
                return False
            log.info(
                "rank %s: aborted its process groups; the torch thread returned from:\n%s",
                self.spec.rank if self.spec else "?",
                where,
            )
        phases.lap("set-up and abort")
        if self.notices is not None:
            self.notices.release_sigterm()
        if not self._released_at_failure:
            self._torch_thread.submit(self._release_layout).result()
        phases.lap("release")
        log.info(
            "rank %s left its layout in %s",
            self.spec.rank if self.spec else "?",
            phases.describe(),
        )
        # It takes 0.1-0.3 s, so it runs after this call has answered, while the coordinator
        # re-plans and forms; the next set-up runs on the same thread after it, so the old
        # state is gone before the new one is built.
        if not self._released_at_failure:
            self._torch_thread.submit(self._free_old_layout)
        self._released_at_failure = False
        return True

    def park(self) -> bool:
        """Kept warm for the driver's next run (`RankGroup.shutdown`), after `teardown`: give
        the heap's freed pages back to the OS, so an actor waiting for a run does not hold its
        last model's memory. On the torch thread, after the old layout is freed."""
        return self._torch_thread.submit(return_free_host_memory).result()

    def _release_layout(self) -> None:
        if self._copier is not None:
            self._copier.close()  # a copy in flight is held and reported first
            self._copier = None
        self.engine = None
        self.checkpointer = None
        if self._batches is not None:
            self._batches.close()  # a pipeline still starting would go on for nobody
        self._batches = None
        self._setting_up = None
        if dist.is_initialized():  # not after an abort, which has already dropped every group
            dist.destroy_process_group()
        self._store = None  # rank 0's server closes with it
        forget_layout_caches()

    def _free_old_layout(self) -> None:
        """The old layout's model and optimizer sit in reference cycles (modules and their
        hooks): a full collection frees them. Then hand the accelerator's cached blocks back
        and restart the peak statistic, so the next layout (or run: a warm actor) measures its
        own. The host heap keeps its freed pages: the next layout, built at once, reuses them
        instead of faulting in fresh ones (`park` returns them when no layout follows)."""
        started = time.perf_counter()
        freed = gc.collect()
        log.info(
            "actor %d: old layout collected in %.3fs (%d objects)",
            self.actor_index,
            time.perf_counter() - started,
            freed,
        )
        if self._device is not None:
            release_accelerator_memory(self._device)
