"""The rank group: rank actors in node-shaped placement groups, reused across layouts.

Each batch of actors created on one node shares one STRICT_PACK placement group targeted at
that node, so a node's accelerators are reserved together and a lost node takes only its own
groups with it. On a resize the surviving actors are kept (their process group is destroyed,
their Python and torch stay loaded), missing ones are created on the nodes the new layout
uses, and ranks are assigned from the node ids the actors report. This is the only place the
coordinator touches Ray actors; a dead actor shows up in `poll` at once as state "dead".

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
from dataclasses import replace
from typing import TYPE_CHECKING

from raytrain_dt.control import warm_actors
from raytrain_dt.control.actor_slots import (
    ActorSlot,
    NodeReservation,
    StartingActor,
    get_all,
    rank_actor_options,
    started_slot,
)
from raytrain_dt.control.comm_env import RUN_SCOPED_ENV
from raytrain_dt.control.group import FormationFault, PlacementTimedOut
from raytrain_dt.control.placement import assign_ranks
from raytrain_dt.worker.reports import CONTROL_GROUP, RankStatus

if TYPE_CHECKING:
    from raytrain_dt.worker.spec import RankSpec

log = logging.getLogger(__name__)

# How long a kept actor may take to answer its rebind (torn down and idle, it answers at once;
# one whose node died answers with an error, not silence).
REBIND_TIMEOUT_S = 30.0
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
        self.reservations: list[NodeReservation] = []
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
    def _actor_options(self) -> dict:
        return rank_actor_options(self.resource, self.cpus_per_rank)

    def _bundle(self) -> dict:
        options = self._actor_options()
        bundle = {
            "CPU": options.get("num_cpus", 0) + self.data_cpus_per_rank,
            "GPU": options.get("num_gpus", 0),
        }
        bundle.update(options.get("resources", {}))
        return {k: v for k, v in bundle.items() if v}

    def _free_bundles(self, node_id: str) -> list[tuple[object, int]]:
        used = {(id(s.pg), s.bundle_index) for s in [*self.slots, *self.idle, *self.starting]}
        return [
            (r.pg, i)
            for r in self.reservations
            if r.node_id == node_id
            for i in range(r.size)
            if (id(r.pg), i) not in used
        ]

    def _reserve(self, node_id: str, count: int, timeout_s: float | None) -> NodeReservation:
        """Reserve `count` bundles on the node; waits until they are granted unless
        `timeout_s` is None (actors placed in it start once it is)."""
        import ray
        from ray.util.placement_group import NODE_ID_LABEL_KEY, placement_group

        # Pinned to the node by its `ray.io/node-id` label. A soft target (Ray's
        # `_soft_target_node_id`) lands on another node whenever this one is full for the
        # moment (actors just killed there still hold their accelerators): the reservation, and
        # every rank later placed in it, would then stand for the wrong node in the plan's
        # topology (seen: actors warmed for a node started on the other, and a later run found
        # no room where the plan put them).
        pg = placement_group(
            [self._bundle()] * count,
            strategy="STRICT_PACK",
            bundle_label_selector=[{NODE_ID_LABEL_KEY: node_id}] * count,
        )
        if timeout_s is None:
            reservation = NodeReservation(pg, node_id, count)
            self.reservations.append(reservation)
            return reservation
        try:
            ray.get(pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as exc:
            ray.util.remove_placement_group(pg)
            raise PlacementTimedOut(
                f"cluster.placement_timeout_s: no room for {count} ranks of {self.resource} "
                f"(each {_describe(self._bundle())}) on node {node_id[:12]} within "
                f"{timeout_s:.0f}s; free there: {_describe(_free_on(node_id))}",
                node_id,
            ) from exc
        reservation = NodeReservation(pg, node_id, count)
        self.reservations.append(reservation)
        return reservation

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

        places = self._free_bundles(node_id)[:count]
        if len(places) < count:
            reservation = self._reserve(node_id, count - len(places), timeout_s)
            places += [(reservation.pg, i) for i in range(reservation.size)]
        actor_cls = ray.remote(concurrency_groups=ACTOR_CONCURRENCY_GROUPS)(RankWorker)
        started = []
        for pg, bundle_index in places:
            handle = actor_cls.options(
                **self._actor_options(),
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
        """Rank 0's address and a free port there; `FormationFault` when rank 0 died, a
        TimeoutError past `timeout_s`."""
        rank0 = self.slots[0]
        return rank0.ip, get_all([rank0.handle.free_port.remote()], timeout_s, [rank0.node_id])[0]

    def setup(self, specs: list[RankSpec], timeout_s: float | None = None) -> list[dict]:
        """Every rank joins the process group and builds its engine, state and data (a
        collective); each rank's set-up timings, in rank order."""
        if self._data_services is not None:
            self._data_services.join(DATA_SERVICES_WAIT_S)
            self._data_services = None
        return self._call_all("setup", [(spec,) for spec in specs], timeout_s)

    def verify_checkpoint(
        self, uri: str, shares: list[dict[str, dict]], timeout_s: float | None = None
    ) -> list[list[str]]:
        """Each rank checks its share of the checkpoint's files; what each found wrong."""
        return self._call_all("verify_checkpoint", [(uri, share) for share in shares], timeout_s)

    def start(self) -> None:
        """Every rank starts its train loop (in the background: `poll` follows it)."""
        self._call_all("start")

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
        return self._try_call_all("teardown", timeout_s, args, CONTROL_GROUP)

    def request_checkpoint_and_stop(
        self, timeout_s: float = 30.0, memory_only: bool = False
    ) -> list[int]:
        """Every rank saves at the next step boundary and stops there (`memory_only`: into its
        in-memory copies, not storage); the ranks not told."""
        return self._try_call_all("request_checkpoint_and_stop", timeout_s, (memory_only,))

    def _call_all(
        self, method: str, per_rank_args: list[tuple] | None = None, timeout_s: float | None = None
    ) -> list:
        """Call `method` on every rank concurrently (collectives need all ranks in) and wait:
        a TimeoutError (Ray's GetTimeoutError) once that is more than `timeout_s`, `FormationFault`
        as soon as one of them died."""
        refs = [
            getattr(slot.handle, method).remote(*(per_rank_args[rank] if per_rank_args else ()))
            for rank, slot in enumerate(self.slots)
        ]
        return get_all(refs, timeout_s, [slot.node_id for slot in self.slots])

    def poll(self, timeout_s: float = 30.0) -> list[RankStatus]:
        """Every rank's status; an actor that died (or whose node died) is state "dead"."""
        import ray

        refs = [
            slot.handle.poll.options(concurrency_group=CONTROL_GROUP).remote()
            for slot in self.slots
        ]
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        statuses = []
        for rank, ref in enumerate(refs):
            node_id = self.slots[rank].node_id
            try:
                statuses.append(replace(ray.get(ref, timeout=0.5), node_id=node_id))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                dead = isinstance(exc, ray.exceptions.RayActorError)
                statuses.append(
                    RankStatus(
                        rank,
                        "dead" if dead else "unresponsive",
                        error=f"{type(exc).__name__}: {exc}",
                        node_id=node_id,
                    )
                )
        return statuses

    def _try_call_all(
        self,
        method: str,
        timeout_s: float = 30.0,
        args: tuple = (),
        concurrency_group: str | None = None,
    ) -> list[int]:
        """Call `method(*args)` on every rank (in the actor's `concurrency_group`), tolerating
        dead ones; returns the ranks that failed (raised, timed out, or answered False)."""
        import ray

        options = {"concurrency_group": concurrency_group} if concurrency_group else {}
        refs = {
            rank: getattr(self.slots[rank].handle, method).options(**options).remote(*args)
            for rank in range(self.world_size)
        }
        failed = []
        for rank, ref in refs.items():
            try:
                answer = "answered False" if ray.get(ref, timeout=timeout_s) is False else None
            except Exception as exc:
                lines = str(exc).strip().splitlines() or [""]
                answer = f"{type(exc).__name__}: {lines[-1].strip()}"
                if isinstance(exc, ray.exceptions.RayTaskError):  # our code raised: where
                    log.warning("rank %d: %s raised:\n%s", rank, method, str(exc).strip())
            if answer is not None:
                # Why an actor is given up (replaced, with its in-memory copies) is worth a line.
                log.warning("rank %d: %s failed (%s)", rank, method, answer)
                failed.append(rank)
        return failed

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
        still_used = {id(s.pg) for s in [*self.slots, *self.idle, *self.starting]}
        for reservation in [r for r in self.reservations if id(r.pg) not in still_used]:
            self.reservations.remove(reservation)
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(reservation.pg)

    def shutdown(self) -> None:
        """Let every actor go at the run's end; with `keep_warm_s`, those that leave their
        layout cleanly are kept for the driver's next run instead (`warm_actors`)."""
        kept = self._leave_for_next_run() if self.keep_warm_s > 0 else []
        actors = [a for a in [*self.slots, *self.idle, *self.starting] if a not in kept]
        self.slots, self.idle, self.starting = [], [], []
        held = {id(slot.pg) for slot in kept}
        reservations = [r for r in self.reservations if id(r.pg) in held]
        self.reservations = [r for r in self.reservations if id(r.pg) not in held]
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
        """What a kept actor must share with this group to join it: the Ray job, the resource,
        the CPUs per rank, the device setting and the environment it was started with
        (`warm_actors`)."""
        import ray

        env = dict(self.runtime_env.get("env_vars") or {})
        for name in RUN_SCOPED_ENV:
            env.pop(name, None)
        rest = {k: v for k, v in self.runtime_env.items() if k != "env_vars"}
        return (
            ray.get_runtime_context().get_job_id(),
            self.resource,
            self.cpus_per_rank,
            self.data_cpus_per_rank,
            self.device,
            tuple(sorted(env.items())),
            repr(sorted(rest.items())),
        )

    def adopt_warm(self) -> int:
        """Take the actors a finished run of this driver kept warm, when they match this group
        (`_warm_key`), as idle actors for the first formation (which lets go those it does not
        use); release them otherwise. Each is rebound to this run (`RankWorker.rebind`); one
        that does not answer (its node died) is let go. Returns how many were taken."""
        import ray

        kept = warm_actors.take()
        if kept is None:
            return 0
        if kept.key != self._warm_key():
            warm_actors.release(kept)
            return 0
        env = self.runtime_env.get("env_vars") or {}
        run_env = {name: env[name] for name in RUN_SCOPED_ENV if name in env}
        self.reservations += kept.reservations
        # Asked together, each answering for itself: a dead one costs no other's answer.
        first = self._next_index
        refs = [
            slot.handle.rebind.remote(self.run_dir, first + i, run_env)
            for i, slot in enumerate(kept.slots)
        ]
        alive, dead = [], []
        for i, (slot, ref) in enumerate(zip(kept.slots, refs, strict=True)):
            try:
                where = ray.get(ref, timeout=REBIND_TIMEOUT_S)
            except Exception as exc:
                log.warning("a warm actor on node %s is gone: %s", slot.node_id[:12], exc)
                dead.append(slot)
                continue
            alive.append(replace(slot, actor_index=first + i, ip=where["ip"], pid=where["pid"]))
        self._next_index += len(kept.slots)
        self.idle += alive
        self._adopted = {s.actor_index for s in alive}
        self._release(dead)
        log.info("took %d warm rank actors from the driver's last run", len(alive))
        return len(alive)


def _free_on(node_id: str) -> dict:
    """The node's unreserved resources now, as Ray's GCS reports them (what a placement that
    timed out did not find)."""
    from ray._private.state import available_resources_per_node

    try:
        return available_resources_per_node().get(node_id, {})
    except Exception:  # a diagnostic: never the reason a time-out is not reported
        return {}


def _describe(resources: dict) -> str:
    """`CPU 0.75, accelerator 1`: Ray's own resources (node and memory keys left out)."""
    shown = {
        k: round(v, 3)
        for k, v in sorted(resources.items())
        if not k.startswith("node:") and k not in ("memory", "object_store_memory")
    }
    return ", ".join(f"{k} {v:g}" for k, v in shown.items()) or "nothing"
