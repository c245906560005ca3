"""Elastic policy: look at the cluster and the group's health, return a frozen decision.

Pure: no Ray, no torch, no clock of its own (time comes in the observation), so the
coordinator, the unit tests and the simulator all run the very same logic. The coordinator
executes decisions; it never decides in place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from raytrain_dt.config.schema import ElasticConfig
from raytrain_dt.control.placement import counts_by_node
from raytrain_dt.topology.layout import Layout
from raytrain_dt.topology.nodes import NodeInfo


# --- decisions -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Noop:
    reason: str = "nothing changed"


@dataclass(frozen=True)
class Resize:
    """Form the group at `layout` on `nodes`. With `checkpoint_first` the running group saves
    at the next step boundary and stops there (no step lost); without it the group is already
    broken and resumes from the latest committed checkpoint."""

    layout: Layout
    nodes: tuple[str, ...]
    reason: str
    checkpoint_first: bool = False


@dataclass(frozen=True)
class Wait:
    reason: str


@dataclass(frozen=True)
class Fail:
    reason: str


Decision = Noop | Resize | Wait | Fail


# --- what the policy sees --------------------------------------------------------------------
@dataclass(frozen=True)
class Observation:
    now: float
    nodes: tuple[NodeInfo, ...]  # alive nodes with accelerators, sorted by id
    draining: frozenset[str] = frozenset()  # nodes under a preemption notice
    layout: Layout | None = None  # the running layout (None: no group running)
    layout_nodes: tuple[str, ...] = ()
    # "ok", "failed" (a rank died or raised), "hung" (no progress), "notice" (preemption)
    health: str = "ok"
    step: int = 0
    restarts: int = 0
    failures_at_step: int = 0  # consecutive failures at this very step
    waiting_since: float | None = None
    # When the current set of usable nodes was first seen (hysteresis for growing).
    nodes_stable_since: float = 0.0


@dataclass
class FailureStreak:
    """How many times in a row the training itself failed at one step (a rank raised or died
    on its own, a hang, a NaN): `elastic.max_failures_at_step` ends a run that repeats such a
    failure. Node losses and preemptions are the cluster's doing, not the step's: they neither
    count nor break a streak. The coordinator and the simulator both keep one."""

    step: int = -1  # the last completed step when the streak's failures happened
    count: int = 0

    def failed(self, step: int, training_fault: bool) -> None:
        if training_fault:
            self.count = self.count + 1 if step == self.step else 1
            self.step = step

    def progressed(self, step: int) -> None:
        """`step` completed: past the failing one, the streak is over."""
        if step > self.step:
            self.count = 0


@dataclass
class ElasticPolicy:
    cfg: ElasticConfig
    # Layout for a set of nodes, or None when nothing fits / too few nodes.
    plan_for: Callable[[tuple[NodeInfo, ...]], Layout | None]
    history: list[str] = field(default_factory=list)

    def usable(self, obs: Observation) -> tuple[NodeInfo, ...]:
        nodes = tuple(n for n in obs.nodes if n.node_id not in obs.draining)
        if self.cfg.max_nodes is not None:
            # Keep the nodes already in use first, so a resize moves as few ranks as possible.
            nodes = tuple(
                sorted(nodes, key=lambda n: (n.node_id not in obs.layout_nodes, n.node_id))
            )
            nodes = tuple(sorted(nodes[: self.cfg.max_nodes], key=lambda n: n.node_id))
        return nodes

    def _target(self, obs: Observation, reason: str, checkpoint_first: bool) -> Decision:
        nodes = self.usable(obs)
        # Either wait is for capacity the autoscaler may bring, and either is bounded: a run
        # must not sit forever on nodes that cannot train it.
        since = obs.waiting_since if obs.waiting_since is not None else obs.now
        timed_out = obs.now - since >= self.cfg.wait_timeout_s
        if len(nodes) < self.cfg.min_nodes:
            if timed_out:
                return Fail(
                    f"only {len(nodes)} usable nodes for {obs.now - since:.0f}s, "
                    f"below elastic.min_nodes={self.cfg.min_nodes}"
                )
            return Wait(
                f"{reason}; waiting for nodes: {len(nodes)} usable, "
                f"elastic.min_nodes={self.cfg.min_nodes}"
            )
        layout = self.plan_for(nodes)
        if layout is None:
            if timed_out:
                return Fail(
                    f"no layout fits on the {len(nodes)} usable nodes for {obs.now - since:.0f}s "
                    "(elastic.wait_timeout_s; the planner's reason is logged as 'no layout on')"
                )
            return Wait(f"{reason}; no layout fits on {len(nodes)} nodes")
        used = _nodes_for(layout, nodes)
        return Resize(
            layout, used, f"{reason}: {layout.describe()} on {len(used)} nodes", checkpoint_first
        )

    def decide(self, obs: Observation) -> Decision:
        if obs.health in ("failed", "hung"):
            if obs.failures_at_step >= self.cfg.max_failures_at_step:
                return Fail(
                    f"step {obs.step + 1} failed {obs.failures_at_step} times in a row: "
                    "a deterministic failure (bad sample, NaN, bug), not retried"
                )
            if obs.restarts >= self.cfg.max_restarts:
                return Fail(f"elastic.max_restarts={self.cfg.max_restarts} reached")
            return self._target(obs, f"rank {obs.health}", checkpoint_first=False)
        if obs.layout is None:
            return self._target(obs, "start", checkpoint_first=False)
        if obs.health == "notice" or any(n in obs.draining for n in obs.layout_nodes):
            return self._target(obs, "preemption notice", checkpoint_first=True)
        # Growth: a better layout on more accelerators (more nodes, or a node's replaced
        # ranks), once the new capacity has been stable.
        usable = self.usable(obs)
        if (
            sum(n.accelerators for n in usable) > obs.layout.dims.world_size
            and obs.now - obs.nodes_stable_since >= self.cfg.grow_stable_s
        ):
            candidate = self.plan_for(usable)
            if candidate is not None and candidate.dims.world_size > obs.layout.dims.world_size:
                return Resize(
                    candidate,
                    _nodes_for(candidate, usable),
                    f"capacity grew to {len(usable)} nodes: {candidate.describe()}",
                    checkpoint_first=True,
                )
        return Noop()


def _nodes_for(layout: Layout, nodes: tuple[NodeInfo, ...]) -> tuple[str, ...]:
    """The nodes a layout fills (as placement will fill them)."""
    counts = counts_by_node(
        layout.dims.world_size, layout.dims.tp, [(n.node_id, n.accelerators) for n in nodes]
    )
    return tuple(sorted(counts))


def capacity_request(
    elastic: ElasticConfig,
    resource: str,
    nodes: tuple[NodeInfo, ...],
    accelerators_per_node: int,
    num_ranks: int | None,
) -> list[dict]:
    """What the autoscaler is asked for: one node-sized bundle per node the run could use, up
    to `elastic.max_nodes` and no more than `cluster.num_ranks` needs. Empty when neither
    bounds the run (there is no finite capacity to ask for)."""
    per_node = max((n.accelerators for n in nodes), default=accelerators_per_node)
    wanted = elastic.max_nodes
    if num_ranks:
        needed = -(-num_ranks // per_node)
        wanted = needed if wanted is None else min(wanted, needed)
    if wanted is None:
        return []
    return [{resource: per_node} for _ in range(max(wanted, elastic.min_nodes))]
