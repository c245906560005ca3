"""Driver-side fault injection on the embedded simulated cluster: lose, preempt or add nodes.

Rank-level faults (`kill_rank`, `hang_rank`, `kill_rank_mid_save`) fire inside the target
rank (`worker/rank_chaos.py`); the node-level ones here act on `ray.cluster_utils.Cluster` raylets
when the run reaches their step. A `preempt_node` posts a notice and reclaims the node once the
group has drained it. Every action fires once per run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from raytrain_dt.config.schema import ChaosAction

log = logging.getLogger(__name__)

NODE_ACTIONS = ("kill_node", "preempt_node", "add_node")
# How long node actions wait for an added node to be in use, for a layout's first checkpoint,
# and for actors warmed for a grow back (seconds).
CHAOS_ARRIVAL_WAIT_S = 30.0


@dataclass
class Chaos:
    actions: list[ChaosAction]
    simulated: object | None  # ray.cluster_utils.Cluster, when the cluster is simulated
    node_resources: dict = field(default_factory=dict)  # what an added node declares
    fired: set[int] = field(default_factory=set)
    arrived: str | None = None  # the node the last add_node added, and when
    arrived_at: float = 0.0
    # Nodes under a simulated preemption notice -> the index of the action that posted it.
    preempting: dict[str, int] = field(default_factory=dict)
    # The rank actors' worker processes on a node (the simulated nodes all run on this host).
    processes_on: Callable[[str], list[int]] | None = None

    def for_formation(self, begun_step: int) -> list[ChaosAction]:
        """The actions a formation's ranks carry: every one not fired, but a rank's `at:
        forming` or `at: joined` fault only in the first formation once the run has begun its
        step (its target fires it as it joins its peers, or once they all have; it is spent
        with this formation)."""
        carried = []
        for i, a in enumerate(self.actions):
            if i in self.fired:
                continue
            if a.at in ("forming", "joined") and a.action not in NODE_ACTIONS:
                if a.at_step > begun_step:
                    continue
                self.fired.add(i)
            carried.append(a)
        return carried

    def mark_rank_faults_fired(self, up_to_step: int) -> None:
        """After a failure at `up_to_step`, rank faults at or before it have fired (not those
        of a formation: they fire in the formation that follows)."""
        for i, a in enumerate(self.actions):
            if a.action not in NODE_ACTIONS and a.at == "step" and a.at_step <= up_to_step:
                self.fired.add(i)

    def due_node_actions(self, step: int, at: str = "step") -> list[tuple[int, ChaosAction]]:
        return [
            (i, a)
            for i, a in enumerate(self.actions)
            if i not in self.fired and a.action in NODE_ACTIONS and a.at == at and a.at_step <= step
        ]

    def fire_forming(self, begun_step: int, node_of_rank: Callable[[int], str]) -> None:
        """Fire the `at: forming` actions due once the run has begun `begun_step`: the group's
        actors are placed and have not set up (`Formation.form`)."""
        for i, action in self.due_node_actions(begun_step, at="forming"):
            self.fired.add(i)
            log.warning("chaos: kill_node during the formation at step %d", begun_step)
            self.kill_node(node_of_rank(action.target))

    def _require_simulated(self, action: ChaosAction) -> None:
        if self.simulated is None:
            raise RuntimeError(f"chaos action {action.action} needs the embedded simulated cluster")

    def kill_node(self, node_id: str) -> None:
        node = next(n for n in self.simulated.list_all_nodes() if n.node_id == node_id)
        workers = self.processes_on(node_id) if self.processes_on else []
        log.warning("chaos: removing node %s", node_id[:12])
        self.simulated.remove_node(node, allow_graceful=False)
        # A machine that dies takes its processes with it. Removing a simulated node kills its
        # raylet, and its workers exit only once they notice, about a second later here: long
        # enough to join a formation begun meanwhile, and die in the middle of its process
        # groups' connect, which no lost machine's processes could.
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def add_node(self) -> str:
        node = self.simulated.add_node(**self.node_resources)
        log.warning("chaos: added node %s", node.node_id[:12])
        return node.node_id

    def fire_node_actions(
        self,
        step: int,
        layout_nodes: tuple[str, ...],
        settled: bool,
        node_of_rank: Callable[[int], str],
        notice: Callable[[str, str, str], None],
    ) -> None:
        """Fire the node actions due at `step`. `settled`: the layout has committed a
        checkpoint of its own, or has been formed for long enough, and no actors are warming
        for a grow back (however long they take); `notice(node, source, detail)` posts a preemption notice."""
        # Node actions play out in order: the next waits until an added node is in use (for
        # at most CHAOS_ARRIVAL_WAIT_S). Starting a raylet takes seconds, tiny steps 0.1 s:
        # without this, an arrival and the next fault land at once and the story is not told.
        if (
            self.arrived not in (None, *layout_nodes)
            and time.time() - self.arrived_at < CHAOS_ARRIVAL_WAIT_S
        ):
            return
        # Nor before the layout has settled (so that each fault hits a layout that has
        # trained, and rewinds at most to its own checkpoint).
        if not settled:
            return
        for i, action in self.due_node_actions(step):
            if action.action == "kill_node":
                self.fired.add(i)
                self.kill_node(node_of_rank(action.target))
            elif action.action == "add_node":
                self.fired.add(i)
                self.arrived, self.arrived_at = self.add_node(), time.time()
                return
            elif action.action == "preempt_node" and i not in self.preempting.values():
                node = node_of_rank(action.target)
                self.preempting[node] = i
                notice(node, "chaos", f"preempt_node at step {action.at_step}")

    def reclaim_preempted(self) -> None:
        """The notices have been served (the group drained): reclaim those nodes."""
        for node, index in self.preempting.items():
            self.fired.add(index)
            self.kill_node(node)
        self.preempting.clear()
