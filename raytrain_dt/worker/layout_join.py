"""Joining a layout inside a rank actor: `JoinsLayouts`, the half of `RankWorker` that sets a
layout up on its torch thread. It opens the rank's input, joins the layout's process groups,
builds the engine (the model's skeleton, then only this rank's shards), restores the state (from
in-memory copies or a checkpoint), warms up the first step's one-time costs and sets up its
savers (`RankCheckpointer`, the in-memory `PeerCopier`), timing each part. Its counterpart,
leaving a layout, is `layout_release.LeavesLayouts`.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING

from raytrain_dt.accel.device import (
    host_memory,
    ray_accelerator_index,
    ray_device_kind,
    reset_host_peak,
    select_device,
)
from raytrain_dt.checkpoint.record import tensor_shapes
from raytrain_dt.data.input_pipeline import DataPlacement
from raytrain_dt.engines.base import EngineBuild
from raytrain_dt.engines.factory import build_engine
from raytrain_dt.models.materialize import initial_weights
from raytrain_dt.models.model_spec import llama_spec
from raytrain_dt.worker.checkpointing import RankCheckpointer
from raytrain_dt.worker.input_stream import InputStream
from raytrain_dt.worker.layout_release import layout_process_groups
from raytrain_dt.worker.peer_copies import CopyStore, PeerCopier, load_from_copies
from raytrain_dt.worker.rank_chaos import RankChaos
from raytrain_dt.worker.rendezvous import join_layout
from raytrain_dt.worker.spec import RankSpec

if TYPE_CHECKING:
    import torch.distributed as dist

    from raytrain_dt.accel.device import DeviceSpec
    from raytrain_dt.engines.base import Engine

log = logging.getLogger("raytrain_dt.rank")


class JoinsLayouts:
    """Setting a layout up, for `RankWorker`, which holds these (`RankWorker.__init__`) and
    calls `_build` on its torch thread (`RankWorker.setup`)."""

    actor_index: int
    engine: Engine | None
    checkpointer: RankCheckpointer | None
    copies: CopyStore  # the in-memory copies this actor holds: they outlive layouts
    _copier: PeerCopier | None  # with in-memory copies on
    _batches: InputStream | None
    _store: dist.Store | None  # the layout's (rank 0 serves it)
    _served_store: dist.TCPStore | None  # served for the next layout, as its rank 0
    _device: DeviceSpec | None
    _chaos: RankChaos
    _tensor_shapes: dict  # the full model's, for the checkpoint record
    _reports: queue.Queue  # what `poll` hands the coordinator
    _polls: int
    _stop: threading.Event  # ends the loop, and a set-up's wait for its peers
    _torch_thread_id: int
    _layout_groups: list  # weak references to the layout's process groups

    @staticmethod
    def _open_input(spec: RankSpec, start_at_once: bool) -> InputStream:
        return InputStream(
            spec.data,
            spec.cfg.data.prefetch_batches,
            DataPlacement.of_this_actor(spec.cfg.cluster.data_cpus_per_rank),
            start_at_once,
        )

    def _build(self, spec: RankSpec) -> dict:
        """Set `spec`'s layout up on the torch thread (collective: every rank of the layout
        builds at once). Returns where its seconds went and the host memory the model's build
        took, which the coordinator records (the formation's phases, `model_built`)."""
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
        served, self._served_store = self._served_store, None  # the layout's store holds it
        joined = join_layout(spec, device.backend, device.device_type, self._stop, served)
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
        self._layout_groups = layout_process_groups()  # every group it made, for its release
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
