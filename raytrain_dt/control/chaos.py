"""Driver-side fault injection on the embedded simulated cluster: lose, preempt or add nodes.

Rank-level faults (`kill_rank`, `hang_rank`) fire inside the target rank's train loop; the
node-level ones here act on `ray.cluster_utils.Cluster` raylets when the run reaches their
step. Every action fires once per run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from raytrain_dt.config.schema import ChaosAction

log = logging.getLogger(__name__)

NODE_ACTIONS = ("kill_node", "preempt_node", "add_node")


@dataclass
class Chaos:
    actions: list[ChaosAction]
    simulated: object | None  # ray.cluster_utils.Cluster, when the cluster is simulated
    node_resources: dict = field(default_factory=dict)  # what an added node declares
    fired: set[int] = field(default_factory=set)
    arrived: str | None = None  # the node the last add_node added, and when
    arrived_at: float = 0.0

    def remaining(self) -> list[ChaosAction]:
        return [a for i, a in enumerate(self.actions) if i not in self.fired]

    def mark_rank_faults_fired(self, up_to_step: int) -> None:
        """After a failure at `up_to_step`, rank faults at or before it have fired."""
        for i, a in enumerate(self.actions):
            if a.action not in NODE_ACTIONS and a.at_step <= up_to_step:
                self.fired.add(i)

    def due_node_actions(self, step: int) -> list[tuple[int, ChaosAction]]:
        return [(i, a) for i, a in enumerate(self.actions)
                if i not in self.fired and a.action in NODE_ACTIONS and a.at_step <= step]  # fmt: skip

    def _require_simulated(self, action: ChaosAction) -> None:
        if self.simulated is None:
            raise RuntimeError(f"chaos action {action.action} needs the embedded simulated cluster")

    def kill_node(self, node_id: str) -> None:
        node = next(n for n in self.simulated.list_all_nodes() if n.node_id == node_id)
        log.warning("chaos: removing node %s", node_id[:12])
        self.simulated.remove_node(node, allow_graceful=False)

    def add_node(self) -> str:
        node = self.simulated.add_node(**self.node_resources)
        log.warning("chaos: added node %s", node.node_id[:12])
        return node.node_id
