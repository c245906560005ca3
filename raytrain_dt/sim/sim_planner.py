"""The planner the simulated coordinator asks, and the price of a layout and a checkpoint.

`SimPlanner` wraps the coordinator's own `plan_for_nodes` (the very function
`Coordinator._plan_for` calls) with a cache keyed by what a plan depends on (node count and
accelerators), and prices any layout with the planner's step-time model (`topology/cost.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raytrain_dt.config.schema import TrainConfig
from raytrain_dt.models.config_shape import config_shape
from raytrain_dt.models.presets import ModelShape
from raytrain_dt.sim.costs import Costs, checkpoint_bytes
from raytrain_dt.topology.cost import PCIE_BANDWIDTH, estimate_step_time
from raytrain_dt.topology.layout import Layout
from raytrain_dt.topology.nodes import NodeInfo, planning_topology
from raytrain_dt.topology.precision import resolve_precision
from raytrain_dt.topology.run_plan import plan_for_nodes


@dataclass
class SimPlanner:
    """The coordinator's planner for a simulated homogeneous cluster, cached by node count."""

    cfg: TrainConfig
    resource: str = "GPU"
    node_memory_bytes: float = 0.0
    shape: ModelShape = field(init=False)
    _plans: dict = field(default_factory=dict, init=False)
    _step_s: dict = field(default_factory=dict, init=False)
    calls: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.shape = config_shape(self.cfg)
        self.precision = resolve_precision(self.cfg.engine.precision, self.resource == "GPU")

    def node(self, node_id: str, accelerators: int) -> NodeInfo:
        return NodeInfo(node_id, accelerators, self.node_memory_bytes)

    def plan_for(self, nodes: tuple[NodeInfo, ...]) -> Layout | None:
        """What `Coordinator._plan_for` returns for these nodes."""
        if not nodes:
            return None
        key = (len(nodes), max(n.accelerators for n in nodes), sum(n.accelerators for n in nodes))
        if key not in self._plans:
            self.calls += 1
            planned = plan_for_nodes(self.cfg, self.shape, self.resource, nodes)
            self._plans[key] = planned.best.layout if planned else None
            if planned:
                self._step_s[planned.best.layout] = planned.best.step_time.total_s
        return self._plans[key]

    def step_s(self, layout: Layout, costs: Costs, accelerators_per_node: int) -> float:
        """Seconds per step: measured if the costs say so, else the planner's model."""
        if layout.dims.world_size in costs.step_s_by_world:
            return costs.step_s_by_world[layout.dims.world_size]
        if layout not in self._step_s:
            per_node = min(accelerators_per_node, layout.dims.world_size)
            nodes = [
                self.node(f"n{i}", per_node) for i in range(layout.dims.world_size // per_node)
            ]
            topo = planning_topology(self.cfg.cluster, self.resource, nodes, layout.dims.world_size)
            self._step_s[layout] = estimate_step_time(
                self.shape, layout, topo, seq_len=self.cfg.data.seq_len, precision=self.precision
            ).total_s
        return self._step_s[layout]

    def save_s(self, costs: Costs, nodes: int) -> float:
        if costs.ckpt_save_s is not None:
            return costs.ckpt_save_s
        return self._transfer_s(costs, nodes)

    def load_s(self, costs: Costs, nodes: int) -> float:
        if costs.ckpt_load_s is not None:
            return costs.ckpt_load_s
        return self._transfer_s(costs, nodes)

    def stall_s(self, costs: Costs, world: int) -> float:
        if costs.ckpt_stall_s is not None:
            return costs.ckpt_stall_s
        return checkpoint_bytes(self.shape, self.precision) / max(1, world) / PCIE_BANDWIDTH

    def _transfer_s(self, costs: Costs, nodes: int) -> float:
        bandwidth = min(costs.storage_gb_per_s, costs.node_storage_gb_per_s * max(1, nodes)) * 1e9
        return checkpoint_bytes(self.shape, self.precision) / bandwidth
