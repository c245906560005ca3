"""Set up and run a comparison: the three policies on one trace, and a checkpoint-interval sweep.

`scale_config` builds the `TrainConfig` the simulated coordinator plans with (a model preset on
GPUs); `compare` runs every (policy, interval) pair on the same trace with one shared plan
cache, and scores each run against the best layout for the whole cluster.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from raytrain_dt.config.schema import ElasticConfig, TrainConfig, memory_copy_interval
from raytrain_dt.config.validation import validate
from raytrain_dt.control.placement import counts_by_node
from raytrain_dt.errors import UserError
from raytrain_dt.sim import strategies
from raytrain_dt.sim.costs import Costs
from raytrain_dt.sim.group_model import SimResult, node_name
from raytrain_dt.sim.loop import Simulation
from raytrain_dt.sim.sim_planner import SimPlanner
from raytrain_dt.sim.trace import StepTrace, Trace
from raytrain_dt.topology.nodes import planning_topology

# Elastic settings for a week on 1,024 nodes: restarts and waits are routine there, so the
# limits that guard a small run are lifted (a second node lost before the first step after a
# restart would otherwise count as a deterministic failure at that step); growth waits for 5
# minutes of stable capacity.
SCALE_ELASTIC = {
    "max_restarts": 10**9,
    "max_failures_at_step": 10**9,
    "wait_timeout_s": 10**9,
    "grow_stable_s": 300.0,
}


def scale_config(
    model: str,
    gpus_per_node: int,
    seq_len: int,
    global_batch: int,
    elastic: dict | None = None,
    batch_tolerance: float = 0.0,
) -> TrainConfig:
    cfg = TrainConfig()
    cfg.model.preset = model
    cfg.data.seq_len = seq_len
    cfg.trainer.global_batch = global_batch
    cfg.trainer.batch_tolerance = batch_tolerance
    cfg.cluster.accelerators_per_node = gpus_per_node
    cfg.elastic = ElasticConfig(**{**SCALE_ELASTIC, **(elastic or {})})
    return validate(cfg)


@dataclass
class Setup:
    planner: SimPlanner
    costs: Costs
    gpus_per_node: int
    nodes: int
    elastic: ElasticConfig
    # Steps between `ours`'s in-memory copies (0: none); None: the config's
    # checkpoint.memory_every_steps, as the run it replays.
    memory_every: int | None = None

    def __post_init__(self) -> None:
        if self.memory_every is None:
            self.memory_every = memory_copy_interval(self.planner.cfg.checkpoint, on_gpu=True)
        every = tuple(
            self.planner.node(node_name(i), self.gpus_per_node) for i in range(self.nodes)
        )
        self.best = self.planner.plan_for(every)
        if self.best is None:
            raise UserError(f"--nodes: no layout of the model fits on {self.nodes} nodes")
        self.best_step_s = self.planner.step_s(self.best, self.costs, self.gpus_per_node)
        self.best_samples_per_s = self.best.global_batch / self.best_step_s
        used = counts_by_node(
            self.best.dims.world_size,
            self.best.dims.tp,
            [(n.node_id, n.accelerators) for n in every],
        )
        self.best_nodes = len(used)
        topo = planning_topology(
            self.planner.cfg.cluster, self.planner.resource, list(every), self.best.dims.world_size
        )
        self.memory_per_accelerator = topo.memory_per_accelerator

    def strategy(self, name: str) -> strategies.Strategy:
        if name == "ours":
            return strategies.ours(self.planner, self.elastic, self.memory_every)
        if name == "restart":
            return strategies.restart(self.best, self.best_nodes)
        if name == "dp_only":
            return strategies.dp_only(
                self.planner, self.best, self.gpus_per_node, self.memory_per_accelerator
            )
        raise UserError(f"--policies: {name!r} is not one of {', '.join(strategies.POLICY_NAMES)}")

    def run(
        self, name: str, trace: Trace | StepTrace, ckpt_every: int, total_steps: int | None = None
    ) -> SimResult:
        return Simulation(
            self.strategy(name),
            trace,
            self.planner,
            self.costs,
            self.gpus_per_node,
            ckpt_every,
            self.best_samples_per_s,
            self.elastic.grow_stable_s,
            self.elastic.wait_timeout_s,
            total_steps,
        ).run()

    def score(self, r: SimResult) -> dict:
        """The report's row for one run."""
        c, gpus = self.costs, self.best_nodes * self.gpus_per_node
        on_demand_h = r.samples / self.best_samples_per_s / 3600  # same work, no interruptions
        spot_usd = r.gpu_hours_held * c.spot_usd_per_gpu_h
        on_demand_usd = on_demand_h * gpus * c.on_demand_usd_per_gpu_h
        return {
            "policy": r.policy,
            "batch": r.batch,
            "ckpt_every": r.ckpt_every,
            "goodput": r.samples / (r.wall_s * self.best_samples_per_s) if r.wall_s else 0.0,
            "steps": r.steps,
            "samples": r.samples,
            "steps_lost": r.steps_lost,
            "lost_compute_h": r.lost_compute_s / 3600,
            "down_h": r.down_s / 3600,
            "degraded_h": r.degraded_s / 3600,
            "below_best_h": (r.down_s + r.degraded_s) / 3600,
            "failures": r.failures,
            "drains": r.drains,
            "memory_restores": r.memory_restores,
            "formations": len(r.formations),
            "spot_usd": spot_usd,
            "on_demand_usd_same_work": on_demand_usd,
            "spot_saving": 1 - spot_usd / on_demand_usd if on_demand_usd else 0.0,
            "failed": r.failed,
        }


def compare(
    setup: Setup,
    trace: Trace,
    ckpt_every: int,
    sweep: list[int],
    names: tuple[str, ...] = strategies.POLICY_NAMES,
) -> dict:
    """Every policy at `ckpt_every` plus the sweep; the same trace and plan cache for all."""
    started = time.perf_counter()
    intervals = sorted({ckpt_every, *sweep})
    runs: dict[tuple[str, int], SimResult] = {}
    for name in names:
        for every in intervals:
            runs[name, every] = setup.run(name, trace, every)
    rows = {key: setup.score(r) for key, r in runs.items()}
    best_interval = {
        name: max(intervals, key=lambda e, n=name: rows[n, e]["goodput"]) for name in names
    }
    return {
        "model": setup.planner.cfg.model.preset,
        "nodes": setup.nodes,
        "gpus_per_node": setup.gpus_per_node,
        "days": trace.duration_s / 86400,
        "trace": {"source": trace.source, **trace.counts()},
        "best_layout": setup.best.describe(),
        "best_step_s": setup.best_step_s,
        "best_nodes": setup.best_nodes,
        "global_batch": setup.best.global_batch,
        "batch_tolerance": setup.planner.cfg.trainer.batch_tolerance,
        "memory_every": setup.memory_every,
        "costs": {k: v for k, v in asdict(setup.costs).items() if k != "step_s_by_world"},
        "checkpoint_s": {
            "save": setup.planner.save_s(setup.costs, setup.best_nodes),
            "load": setup.planner.load_s(setup.costs, setup.best_nodes),
            "stall": setup.planner.stall_s(setup.costs, setup.best.dims.world_size),
        },
        "elastic": asdict(setup.elastic),
        "ckpt_every": ckpt_every,
        "comparison": [rows[name, ckpt_every] for name in names],
        "sweep": [rows[name, e] for name in names for e in intervals],
        "best_interval": {
            n: {"ckpt_every": e, "goodput": rows[n, e]["goodput"]} for n, e in best_interval.items()
        },
        "timelines": {name: runs[name, ckpt_every].timeline for name in names},
        "formations": {name: runs[name, ckpt_every].formations[:200] for name in names},
        "plans_computed": setup.planner.calls,
        "sim_wall_s": time.perf_counter() - started,
    }


def default_sweep(best_step_s: float) -> list[int]:
    """Checkpoint intervals from about 2 minutes to 2 hours of steps at the best layout."""
    return sorted({max(1, round(m * 60 / best_step_s)) for m in (2, 5, 10, 20, 40, 120)})


__all__ = ["Setup", "compare", "default_sweep", "scale_config"]
