"""The layout a run's config gets on a set of nodes: the config's pins and precision handed to
the planner, and the size of the checkpoint that layout writes.

Pure (no Ray, no torch): the coordinator plans with it, and the simulator calls the very same
functions (`sim/sim_planner.py`).

Elastic re-planning keeps a pinned `parallel.cp` or `parallel.ep` as an upper bound: where the
nodes left can no longer hold the pinned degree (an ep that divides no dp_shard of the smaller
world), the run goes on at the largest divisor of it that they can, and returns to the pin when
the nodes come back (`plan_for_nodes`). The checkpoint reshards to it like any other layout.
"""

from __future__ import annotations

import dataclasses
import logging

from raytrain_dt.config.schema import TrainConfig, memory_copy_interval
from raytrain_dt.errors import ConfigError, PlanningError
from raytrain_dt.models.presets import ModelShape
from raytrain_dt.topology.host_memory import checkpoint_bytes
from raytrain_dt.topology.layout import Layout, Topology
from raytrain_dt.topology.nodes import NodeInfo, planning_topology
from raytrain_dt.topology.pins import (
    LayoutPins,
    context_parallel_refusal,
    engine_pins,
    engine_refusal,
    model_refusal,
)
from raytrain_dt.topology.plan_result import Plan
from raytrain_dt.topology.planner import plan
from raytrain_dt.topology.precision import resolve_precision

log = logging.getLogger(__name__)


def check_parallel_pins(cfg: TrainConfig, shape: ModelShape) -> None:
    """A one-line ConfigError for a pinned cp or ep the model or the engine has no structure
    for, whatever the cluster: checked before any actor starts."""
    pins = LayoutPins.from_config(cfg)
    refusal = (
        model_refusal(shape, pins, cp_attention=not cfg.model.hf)
        or context_parallel_refusal(pins.cp or 1, cfg.data.seq_len)
        or engine_refusal(
            cfg.engine.name, None, None, None, cp=pins.cp, ep=pins.ep, moe=shape.is_moe
        )
    )
    if refusal:
        raise ConfigError(refusal)


def choose_layout(
    cfg: TrainConfig,
    shape: ModelShape,
    topology: Topology,
    on_gpu: bool,
    pins: LayoutPins | None = None,
) -> Plan:
    """Plan the layout for this cluster; whatever the config pins (or `pins`, where elastic
    re-planning relaxes them) is honoured and validated."""
    pins = engine_pins(cfg.engine.name, pins or LayoutPins.from_config(cfg))
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
        cp_attention=not cfg.model.hf,
    )


def relaxed_pins(pins: LayoutPins) -> list[LayoutPins]:
    """`pins` with a pinned cp and ep taken as upper bounds: the pins themselves first, then
    every smaller divisor pair of them, the largest product first."""
    cps = [c for c in range(pins.cp or 1, 0, -1) if (pins.cp or 1) % c == 0]
    eps = [e for e in range(pins.ep or 1, 0, -1) if (pins.ep or 1) % e == 0]
    pairs = sorted(((c, e) for c in cps for e in eps), key=lambda p: (-p[0] * p[1], -p[1]))
    return [
        dataclasses.replace(pins, cp=c if pins.cp else None, ep=e if pins.ep else None)
        for c, e in pairs
    ]


def plan_for_nodes(
    cfg: TrainConfig, shape: ModelShape, resource: str, nodes: tuple[NodeInfo, ...]
) -> Plan | None:
    """The planner's answer for these nodes (None when nothing fits there)."""
    if not nodes:
        return None
    available = sum(n.accelerators for n in nodes)
    world = min(cfg.cluster.num_ranks or available, available)
    topology = planning_topology(cfg.cluster, resource, list(nodes), world)
    # What the model or engine refuses is the config's fault, not the nodes': no relaxing it.
    check_parallel_pins(cfg, shape)
    errors: list[Exception] = []
    for pins in relaxed_pins(LayoutPins.from_config(cfg)):
        try:
            planned = choose_layout(cfg, shape, topology, resource == "GPU", pins)
        except (PlanningError, ConfigError) as exc:
            # A pinned cp or ep the smaller world cannot hold is a reason to relax it.
            errors.append(exc)
            continue
        if errors:
            d = planned.best.layout.dims
            log.warning(
                "parallel.cp=%s, parallel.ep=%s do not fit %d node(s) (%s): planned cp=%d, ep=%d",
                cfg.parallel.cp,
                cfg.parallel.ep,
                len(nodes),
                errors[0],
                d.cp,
                d.ep,
            )
        return planned
    if all(isinstance(e, ConfigError) for e in errors):
        raise errors[0]  # the config's, whatever the nodes
    log.warning("no layout on %d nodes: %s", len(nodes), errors[-1])
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
