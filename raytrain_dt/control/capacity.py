"""Capacity: what to ask of the autoscaler, which actors to start ahead of need, and which of
the cluster's accelerators the policy may plan for (only those whose actors have started).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field, replace

from raytrain_dt.config.schema import TrainConfig
from raytrain_dt.control.cluster import ClusterView
from raytrain_dt.control.group import RankGroupLike
from raytrain_dt.control.policies import capacity_request
from raytrain_dt.control.run_state import RunState
from raytrain_dt.data.autoscaler_requests import REQUEST_EXPIRY_S
from raytrain_dt.observe.metrics import RunRecorder
from raytrain_dt.topology.nodes import NodeInfo

log = logging.getLogger(__name__)

# Well within the expiry of a request Ray Data's coordinator holds.
REQUEST_REFRESH_S = REQUEST_EXPIRY_S / 10


@dataclass
class Capacity:
    cfg: TrainConfig
    resource: str
    cluster: ClusterView
    group: RankGroupLike
    run: RunState
    recorder: RunRecorder
    _asked_at: float = field(default=0.0, init=False)  # time.monotonic() of the last ask

    def request(self, nodes: tuple[NodeInfo, ...]) -> None:
        """Ask the autoscaler for what the run can use when that changes, and the same again
        every `REQUEST_REFRESH_S`: Ray Data's coordinator, where one runs, drops a request it
        holds once it is `REQUEST_EXPIRY_S` old, and one that started after the run asked
        replaces the run's request until the run asks through it
        (`data/autoscaler_requests.py`)."""
        bundles = self._bundles(nodes)
        if bundles != self.run.capacity_requested:
            self._ask(bundles)
        elif bundles and time.monotonic() - self._asked_at > REQUEST_REFRESH_S:
            self.cluster.request_capacity(bundles)
            self._asked_at = time.monotonic()

    def withdraw(self) -> None:
        """Take the request back at the run's end: Ray keeps a request in force until the next
        one, so nodes would stay requested (and paid for) after the run. Also when this driver
        has not asked yet: a run that asks at all may resume a killed driver, whose request
        still stands. A run that never asks leaves the autoscaler alone."""
        if not (self.run.capacity_requested or self._bundles(())):
            return
        try:
            self._ask([])
        except Exception as exc:  # the run's own outcome (a failure, Ctrl-C) must stand
            log.warning(
                "could not withdraw the autoscaler request (%s: %s): nodes stay requested until "
                "request_resources(bundles=[]) is called on the cluster",
                type(exc).__name__,
                exc,
            )

    def _bundles(self, nodes: tuple[NodeInfo, ...]) -> list[dict]:
        return capacity_request(
            self.cfg.elastic,
            self.resource,
            nodes,
            self.cfg.cluster.accelerators_per_node,
            self.cfg.cluster.num_ranks,
        )

    def _ask(self, bundles: list[dict]) -> None:
        self.run.capacity_requested = bundles
        self.cluster.request_capacity(bundles)
        self._asked_at = time.monotonic()
        self.recorder.event("capacity_request", bundles=bundles)

    def warm(
        self, nodes: tuple[NodeInfo, ...], draining: frozenset[str], waiting: bool
    ) -> tuple[NodeInfo, ...]:
        """Start actors ahead of need where a node has room for more than the group has
        there (a dead rank's replacement, a node that joined), up to the ranks the run can
        use; and show the policy only capacity with started actors. So a failure re-forms at
        once on the survivors, an arrival is planned for once its actors have imported torch,
        and either grows the group through the normal grow path (a just-in-time checkpoint at
        a step boundary) once the new actors are warm: all of them, so that it grows once
        (while a group runs, the policy sees only its ranks until then; after a failure, a
        node without survivors shows once its actors are all up). `waiting`: the run waits
        for capacity (survivors too few to train)."""
        group = self.group
        if not self.run.formed:
            return nodes  # the first formation starts its actors itself
        group.drop_spares(
            {a.node_id for a in [*group.idle, *group.starting]} - {n.node_id for n in nodes}
        )
        group.collect_warm()
        if self._recovering_on_survivors(waiting):
            # Survivors re-form first and replacements start after its first step: a new
            # actor's start (a Python process importing torch) would take the CPU the
            # re-formation needs (on a shared host, or where CPUs are few). Plan for the
            # actors that have started.
            started = {
                n.node_id: group.actors_on(n.node_id) - group.starting_on(n.node_id) for n in nodes
            }
            shown = [
                replace(n, accelerators=min(n.accelerators, started[n.node_id])) for n in nodes
            ]
            return tuple(n for n in shown if n.accelerators > 0)
        usable = [n for n in nodes if n.node_id not in draining]
        budget = self.cfg.cluster.num_ranks or sum(n.accelerators for n in usable)
        budget -= group.actor_count()
        for node in usable:
            room = min(node.accelerators - group.actors_on(node.node_id), budget)
            if room > 0:
                group.warm(node.node_id, room)
                budget -= room
        if not (group.slots or group.idle):
            return nodes  # nothing else could train sooner: the formation waits for them
        if group.starting and self.run.layout is not None:
            # A running group grows once every actor being started is up: one resize.
            ranks = Counter(s.node_id for s in group.slots)
            return tuple(
                replace(n, accelerators=ranks[n.node_id]) for n in nodes if ranks[n.node_id]
            )
        survivors = {s.node_id for s in group.slots}
        shown = [
            replace(n, accelerators=n.accelerators - group.starting_on(n.node_id))
            for n in nodes
            if n.node_id in survivors or not group.starting_on(n.node_id)
        ]
        return tuple(n for n in shown if n.accelerators > 0)

    def _recovering_on_survivors(self, waiting: bool) -> bool:
        """Reusable actors are being re-formed (after a failure: no layout runs) or their new
        layout has not completed its first step. Not while waiting: the survivors were too
        few to train, and the capacity they wait for must be started."""
        if not (self.group.slots or self.group.idle) or waiting:
            return False
        return self.run.layout is None or self.run.formation_timer is not None
