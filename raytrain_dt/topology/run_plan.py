"""The layout a run's config gets on a set of nodes: the config's pins and precision handed to
the planner, and the size of the checkpoint that layout writes.

Pure (no Ray, no torch): the coordinator plans with it, and the simulator calls the very same
functions (`sim/sim_planner.py`).
"""

from __future__ import annotations

import logging

from raytrain_dt.config.schema import TrainConfig, memory_copy_interval
from raytrain_dt.errors import PlanningError
from raytrain_dt.models.presets import ModelShape
from raytrain_dt.topology.host_memory import checkpoint_bytes
from raytrain_dt.topology.layout import Layout, Topology
from raytrain_dt.topology.nodes import NodeInfo, planning_topology
from raytrain_dt.topology.pins import LayoutPins, engine_pins
from raytrain_dt.topology.planner import Plan, plan
from raytrain_dt.topology.precision import resolve_precision

log = logging.getLogger(__name__)


def choose_layout(cfg: TrainConfig, shape: ModelShape, topology: Topology, on_gpu: bool) -> Plan:
    """Plan the layout for this cluster; whatever the config pins is honoured and validated."""
    pins = engine_pins(cfg.engine.name, LayoutPins.from_config(cfg))
    return plan(
        shape,
        topology,
        global_batch=cfg.trainer.global_batch,
        seq_len=cfg.data.seq_len,
        pins=pins,
        precision=resolve_precision(cfg.engine.precision, on_gpu),
        engine=cfg.engine.name,
        async_save=cfg.checkpoint.async_save,
        batch_tolerance=cfg.trainer.batch_tolerance,
        memory_copies=memory_copy_interval(cfg.checkpoint, on_gpu) > 0,
    )


def plan_for_nodes(
    cfg: TrainConfig, shape: ModelShape, resource: str, nodes: tuple[NodeInfo, ...]
) -> Plan | None:
    """The planner's answer for these nodes (None when nothing fits there)."""
    if not nodes:
        return None
    available = sum(n.accelerators for n in nodes)
    world = min(cfg.cluster.num_ranks or available, available)
    topology = planning_topology(cfg.cluster, resource, list(nodes), world)
    try:
        return choose_layout(cfg, shape, topology, resource == "GPU")
    except PlanningError as exc:
        log.warning("no layout on %d nodes: %s", len(nodes), exc)
        return None


def planned_checkpoint_bytes(
    cfg: TrainConfig, shape: ModelShape, layout: Layout, on_gpu: bool
) -> float:
    """The memory model's size of this run's checkpoint at `layout` (before one is measured)."""
    return checkpoint_bytes(
        shape,
        engine=cfg.engine.name,
        zero_stage=layout.zero_stage,
        precision=resolve_precision(cfg.engine.precision, on_gpu),
    )
