"""The rank group: rank actors in node-shaped placement groups, reused across layouts.

Actors live in placement groups pinned to their node (`node_reservations`), so a lost node
takes only its own reservations with it. On a resize the surviving actors are kept (their
process group is destroyed, their Python and torch stay loaded), missing ones are created on
the nodes the new layout uses, and ranks are assigned from the node ids the actors report.
This is the only place the coordinator touches Ray actors (the calls on every rank at once are
`actor_slots`'); a dead actor shows up in `poll` at once as state "dead".

Starting an actor (a process that imports torch) takes seconds, so actors can also be warmed
ahead of need (`warm`: a replacement for a dead rank, the ranks of a node that just joined)
while the group trains; once started they wait `idle`, as do survivors a smaller layout left
out, until a formation takes them. A driver that trains again may keep the healthy actors of
a finished run for its next one (`warm_actors`, `cluster.keep_warm_s`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING

from raytrain_dt.control import warm_actors
from raytrain_dt.control.actor_slots import (
    ActorSlot,
    StartingActor,
    call_all,
    get_all,
    poll_all,
    started_slot,
    try_call_all,
)
from raytrain_dt.control.group import FormationFault
from raytrain_dt.control.node_reservations import NodeReservations
from raytrain_dt.control.placement import assign_ranks
from raytrain_dt.worker.reports import CONTROL_GROUP, RankStatus

if TYPE_CHECKING:
    from raytrain_dt.worker.spec import RankSpec

log = logging.getLogger(__name__)

# How long a finished run's ranks may take to leave their layout before they are killed.
END_TEARDOWN_S = 30.0
# How long a first set-up waits for Ray Data's actors to be created on the driver's node (an
# import and two actor registrations, about 1 s); past it the ranks' pipelines create them.
DATA_SERVICES_WAIT_S = 30.0


class RankGroup:
    def __init__(
        self,
        run_dir: str,
        resource: str,
        cpus_per_rank: float,
        runtime_env: dict | None = None,
        keep_warm_s: float = 0.0,
        device: str = "auto",
        data_cpus_per_rank: float = 0.0,
    ):
        self.run_dir = run_dir
        self.resource = resource
        self.cpus_per_rank = cpus_per_rank
        # Reserved in each rank's bundle beside its actor's: its input pipeline's tasks run
        # there (`data.input_pipeline.DataPlacement`).
        self.data_cpus_per_rank = data_cpus_per_rank
        self.runtime_env = runtime_env or {}
        self.keep_warm_s = keep_warm_s  # `shutdown` keeps healthy actors for the next run
        # `cluster.device`: a process keeps what its first device set up (autograd's device
        # queues are sized at its first backward), so kept actors serve the same kind only.
        self.device = device
        self.slots: list[ActorSlot] = []  # ordered by rank once `form` has run
        self.idle: list[ActorSlot] = []  # started, in no layout
        self.starting: list[StartingActor] = []
        self.reservations = NodeReservations(resource, cpus_per_rank, data_cpus_per_rank)
        self._next_index = 0
        self._adopted: set[int] = set()  # indices of kept actors no layout has used yet
        self._data_services: threading.Thread | None = None

    def host_data_services(self) -> None:
        """Create Ray Data's cluster-wide actors on this, the driver's, node
        (`host_data_services_here`), while the first formation places and starts its actors;
        the first `setup`, after which ranks read, waits for it."""
        from raytrain_dt.data.input_pipeline import host_data_services_here

        self._data_services = host_data_services_here()

    # --- placement ---------------------------------------------------------------------------
    def _used_bundles(self) -> set[tuple[int, int]]:
        return {(id(s.pg), s.bundle_index) for s in [*self.slots, *self.idle, *self.starting]}

    def _start_on_node(
        self, node_id: str, count: int, timeout_s: float | None, input_workers: bool
    ) -> list[StartingActor]:
        """Start `count` actors in bundles of the node's reservations (reserving more where
        needed). `input_workers`: start each one's input worker beside it
        (`start_input_worker`): for a formation, which waits for its actors anyway, not for
        actors warmed while the group trains, whose pipelines start their worker after their
        first step, as on a re-formation (a joining node's ranks then start no more processes
        than they must before they train)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from raytrain_dt.data.input_pipeline import start_input_worker
        from raytrain_dt.worker.rank_actor import ACTOR_CONCURRENCY_GROUPS, RankWorker

        places = self.reservations.free_bundles(node_id, self._used_bundles())[:count]
        if len(places) < count:
            reservation = self.reservations.reserve(node_id, count - len(places), timeout_s)
            places += [(reservation.pg, i) for i in range(reservation.size)]
        actor_cls = ray.remote(concurrency_groups=ACTOR_CONCURRENCY_GROUPS)(RankWorker)
        started = []
        for pg, bundle_index in places:
            handle = actor_cls.options(
                **self.reservations.actor_options,
                runtime_env=self.runtime_env or None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=bundle_index
                ),
            ).remote(self.run_dir, self._next_index)
            self._next_index += 1
            if input_workers and self.data_cpus_per_rank:
                # Its pipeline's worker process starts now, beside it, not at its first read.
                start_input_worker(
                    pg, bundle_index, self.data_cpus_per_rank, self.runtime_env or None
                )
            started.append(
                StartingActor(handle, handle.where.remote(), node_id, pg, bundle_index, time.time())
            )
        return started

    def _create_on_node(
        self, node_id: str, count: int, timeout_s: float, start_timeout_s: float | None = None
    ) -> list[ActorSlot]:
        """Start actors on the node and wait for them; a TimeoutError (Ray's GetTimeoutError)
        once they have not all started within `start_timeout_s`, `FormationFault` when one died
        while starting (those that did start wait `idle`)."""
        import ray

        started = self._start_on_node(node_id, count, timeout_s, input_workers=True)
        try:
            reports = get_all([a.where for a in started], start_timeout_s, [node_id] * count)
        except FormationFault:
            # Those that started wait idle for the re-plan; the dead and the rest go.
            doomed = []
            for actor in started:
                try:
                    self.idle.append(started_slot(actor, ray.get(actor.where, timeout=0)))
                except Exception:  # dead, or not started yet
                    doomed.append(started_slot(actor, {"node_id": node_id}))
            self._release(doomed)
            raise
        except ray.exceptions.GetTimeoutError:
            self._release([started_slot(a, {"node_id": node_id}) for a in started])
            raise
        return [started_slot(a, r) for a, r in zip(started, reports)]

    # --- actors warmed ahead of need ---------------------------------------------------------
    def warm(self, node_id: str, count: int) -> None:
        """Start `count` more actors on the node in the background (see the module's doc)."""
        self.starting += self._start_on_node(node_id, count, timeout_s=None, input_workers=False)
        log.info("warming %d actors on node %s", count, node_id[:12])

    def collect_warm(self, timeout_s: float = 0.0, give_up_s: float = 300.0) -> None:
        """Move started actors to `idle` (waiting up to `timeout_s` for all of them); forget
        those that died, or that could not be placed in `give_up_s` (node gone or full)."""
        import ray

        if not self.starting:
            return
        refs = [a.where for a in self.starting]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        still, failed = [], []
        for actor in self.starting:
            if not any(actor.where is r for r in ready):
                (failed if time.time() - actor.since > give_up_s else still).append(actor)
                continue
            try:
                where = ray.get(actor.where)
                self.idle.append(started_slot(actor, where))
                # A slow start here (a process importing torch) is what delays a growth.
                log.info(
                    "actor %d on node %s up after %.2fs (imported torch by +%.2fs)",
                    where["actor_index"],
                    actor.node_id[:12],
                    time.time() - actor.since,
                    where["init_at"] - actor.since,
                )
            except Exception as exc:  # died while starting (with its node, most likely)
                log.warning("an actor warming on node %s died: %s", actor.node_id[:12], exc)
                failed.append(actor)
        self.starting = still
        self._release(failed)

    def actors_on(self, node_id: str) -> int:
        """Actors on the node: in the layout, idle or starting."""
        return sum(a.node_id == node_id for a in [*self.slots, *self.idle, *self.starting])

    def starting_on(self, node_id: str) -> int:
        return sum(a.node_id == node_id for a in self.starting)

    def actor_count(self) -> int:
        return len(self.slots) + len(self.idle) + len(self.starting)

    def drop_spares(self, node_ids: set[str]) -> None:
        """Let idle and starting actors on these nodes go (lost, or under notice)."""
        doomed = [a for a in [*self.idle, *self.starting] if a.node_id in node_ids]
        if doomed:
            self.idle = [a for a in self.idle if a not in doomed]
            self.starting = [a for a in self.starting if a not in doomed]
            self._release(doomed)

    def form(
        self, counts_by_node: dict[str, int], timeout_s: float, start_timeout_s: float | None = None
    ) -> None:
        """Have exactly counts_by_node[node] actors on each node: keep survivors, create the
        missing ones, release the rest. Then order slots by rank. `timeout_s`: for placement;
        `start_timeout_s`: for the new actors to start (a TimeoutError past it)."""
        if any(
            count > self.actors_on(n) - self.starting_on(n) for n, count in counts_by_node.items()
        ):
            self.collect_warm(timeout_s)  # actors the layout needs are still starting
        keep: list[ActorSlot] = []
        spare = [*self.slots, *self.idle]
        for node_id, count in counts_by_node.items():
            here = [s for s in spare if s.node_id == node_id][:count]
            for slot in here:
                spare.remove(slot)
            keep += here
            if count > len(here):
                try:
                    created = self._create_on_node(
                        node_id, count - len(here), timeout_s, start_timeout_s
                    )
                except (FormationFault, TimeoutError):
                    # Nothing formed: the group stays as it was, and the actors started for
                    # it so far wait idle for the re-plan.
                    self.idle += [s for s in keep if s not in [*self.slots, *self.idle]]
                    raise
                keep += created
        reports = [{"node_id": s.node_id, "actor_index": s.actor_index} for s in keep]
        ranks = assign_ranks(reports)
        self.slots = [slot for _, slot in sorted(zip(ranks, keep), key=lambda pair: pair[0])]
        self.idle = spare  # healthy and started: kept for a later, larger layout
        if self._adopted:
            # Kept actors the first layout leaves out go, as if the run had started its own:
            # the idle actors a run has are those its own decisions left out.
            unused = [s for s in self.idle if s.actor_index in self._adopted]
            self.idle = [s for s in self.idle if s not in unused]
            self._adopted = set()
            self._release(unused)
        log.info(
            "rank group: %s (idle: %d, starting: %d)",
            {n[:12]: c for n, c in counts_by_node.items()},
            len(self.idle),
            len(self.starting),
        )

    # --- calls -------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self.slots)

    def master_endpoint(self, timeout_s: float | None = None) -> tuple[str, int]:
        """Rank 0's address and the port of the store it now serves for the layout
        (`serve_layout_store`); `FormationFault` when rank 0 died, a TimeoutError past
        `timeout_s`."""
        rank0 = self.slots[0]
        port = get_all([rank0.handle.serve_layout_store.remote()], timeout_s, [rank0.node_id])
        return rank0.ip, port[0]

    def setup(self, specs: list[RankSpec], timeout_s: float | None = None) -> list[dict]:
        """Every rank joins the process group and builds its engine, state and data (a
        collective); each rank's set-up timings, in rank order."""
        if self._data_services is not None:
            self._data_services.join(DATA_SERVICES_WAIT_S)
            self._data_services = None
        return call_all(self.slots, "setup", [(spec,) for spec in specs], timeout_s)

    def verify_checkpoint(
        self, uri: str, shares: list[dict[str, dict]], timeout_s: float | None = None
    ) -> list[list[str]]:
        """Each rank checks its share of the checkpoint's files; what each found wrong."""
        return call_all(
            self.slots, "verify_checkpoint", [(uri, share) for share in shares], timeout_s
        )

    def start(self) -> None:
        """Every rank starts its train loop (in the background: `poll` follows it)."""
        call_all(self.slots, "start")

    def teardown(
        self,
        grace_s: float,
        timeout_s: float = 30.0,
        keep_save: bool = True,
        return_s: float = 0.0,
    ) -> list[int]:
        """Every rank leaves its layout (`RankWorker.teardown`; `grace_s`: for its loop to end
        at a step boundary before its communicators are aborted; `keep_save` False: a durable
        save in flight is abandoned; `return_s`: for a loop whose collectives were aborted to
        return, at least the actor's own floor); the ranks that cannot be reused (stuck, dead
        or silent)."""
        args = (grace_s, keep_save, return_s)
        return try_call_all(self.slots, "teardown", timeout_s, args, CONTROL_GROUP)

    def request_checkpoint_and_stop(
        self, timeout_s: float = 30.0, memory_only: bool = False
    ) -> list[int]:
        """Every rank saves at the next step boundary and stops there (`memory_only`: into its
        in-memory copies, not storage); the ranks not told."""
        return try_call_all(self.slots, "request_checkpoint_and_stop", timeout_s, (memory_only,))

    def poll(self, timeout_s: float = 30.0) -> list[RankStatus]:
        """Every rank's status; an actor that died (or whose node died) is state "dead"."""
        return poll_all(self.slots, timeout_s)

    def drop(self, ranks: list[int]) -> None:
        """Kill these ranks' actors and forget them (dead, hung or on a lost node)."""
        doomed = [self.slots[r] for r in ranks]
        self.slots = [s for s in self.slots if s not in doomed]
        self._release(doomed)

    def _release(self, slots: list[ActorSlot]) -> None:
        """Kill these actors; give back reservations no remaining actor uses."""
        import ray

        for slot in slots:
            with contextlib.suppress(Exception):  # already dead
                ray.kill(slot.handle)
        self.reservations.release_unused(
            {id(s.pg) for s in [*self.slots, *self.idle, *self.starting]}
        )

    def shutdown(self) -> None:
        """Let every actor go at the run's end; with `keep_warm_s`, those that leave their
        layout cleanly are kept for the driver's next run instead (`warm_actors`)."""
        kept = self._leave_for_next_run() if self.keep_warm_s > 0 else []
        actors = [a for a in [*self.slots, *self.idle, *self.starting] if a not in kept]
        self.slots, self.idle, self.starting = [], [], []
        reservations = self.reservations.hand_over({id(slot.pg) for slot in kept})
        self._release(actors)
        if kept:
            warm_actors.keep(
                warm_actors.WarmActors(self._warm_key(), kept, reservations), self.keep_warm_s
            )

    def _leave_for_next_run(self) -> list[ActorSlot]:
        """The actors that can train another run: the layout's ranks that left it cleanly
        (`RankWorker.teardown`) and the idle ones."""
        try:
            stuck = set(self.teardown(grace_s=2.0, timeout_s=END_TEARDOWN_S, keep_save=False))
        except Exception:  # the run's own outcome stands; nothing is kept
            log.exception("the ranks could not leave their layout; no actor is kept warm")
            return []
        kept = [s for rank, s in enumerate(self.slots) if rank not in stuck] + self.idle
        for slot in kept:  # their freed heap back to the OS meanwhile (`RankWorker.park`)
            slot.handle.park.remote()
        return kept

    def _warm_key(self) -> tuple:
        return warm_actors.actor_key(
            self.resource,
            self.cpus_per_rank,
            self.data_cpus_per_rank,
            self.device,
            self.runtime_env,
        )

    def adopt_warm(self) -> int:
        """Take the actors a finished run of this driver kept warm, when they match this group
        (`warm_actors.actor_key`), as idle actors for the first formation (which lets go those
        it does not use); release them otherwise. Each is rebound to this run
        (`warm_actors.rebind`); one that does not answer (its node died) is let go. Returns how
        many were taken."""
        kept = warm_actors.take()
        if kept is None:
            return 0
        if kept.key != self._warm_key():
            warm_actors.release(kept)
            return 0
        self.reservations.held += kept.reservations
        alive, dead = warm_actors.rebind(kept, self.run_dir, self._next_index)
        self._next_index += len(kept.slots)
        self.idle += alive
        self._adopted = {s.actor_index for s in alive}
        self._release(dead)
        log.info("took %d warm rank actors from the driver's last run", len(alive))
        return len(alive)
