"""The policies under test, each as a `Strategy`: a decide function over the coordinator's own
`Observation` returning the coordinator's own decisions, plus how its recoveries behave.

- `ours`: the coordinator's `ElasticPolicy` with the coordinator's planner (`SimPlanner.plan_for`
  wraps `plan_for_nodes`): topology-aware re-planning, JIT checkpoints on notice, growth, and
  in-memory copies every `memory_every` steps (a failure without notice then loses the step in
  flight, unless every holder of some shard is lost: `GroupModel._copies_survive`). Fixed-batch
  with `trainer.batch_tolerance` 0, elastic-batch within the tolerance otherwise.
- `restart`: checkpoint-restart at a fixed size (Ray Train / torchrun today): the full-cluster
  layout, every process restarted, waiting until that many nodes are back; notices ignored.
- `dp_only`: elastic DP-only resize (torchft-like): TP and PP stay as planned for the full
  cluster; a replica group (the fewest nodes whose HSDP shard fits in memory) is the unit that
  comes and goes. Survivors keep their state (no checkpoint reload); a failure loses the step in
  flight; the global batch shrinks with the replicas (each replica keeps its own batch), and
  never exceeds the configured batch (no more replicas than the full layout has): elastic-batch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from raytrain_dt.config.schema import ElasticConfig
from raytrain_dt.control.policies import (
    Decision,
    ElasticPolicy,
    Noop,
    Observation,
    Resize,
    Wait,
)
from raytrain_dt.topology.layout import Layout
from raytrain_dt.topology.memory import estimate_memory
from raytrain_dt.topology.parallel_dims import ParallelDims

if TYPE_CHECKING:
    from raytrain_dt.sim.sim_planner import SimPlanner

POLICY_NAMES = ("restart", "dp_only", "ours")


@dataclass
class Strategy:
    name: str
    decide: Callable[[Observation], Decision]
    uses_notice: bool  # a notice triggers a drain (JIT checkpoint) instead of being ignored
    live_resize: bool  # survivors keep their state: no checkpoint reload, no rollback
    cold_restart: bool  # every formation starts every process anew
    # Samples one step of this layout trains (the global batch, unless the policy shrinks it).
    samples_per_step: Callable[[Layout], int]
    # Actors start on a node as soon as it joins, and the policy sees it once they are up, so
    # the growth that follows pays no actor start (the coordinator's `_warm_capacity`).
    prestarts_actors: bool = False
    # Every step trains the configured global batch (a "fixed-batch" policy), or fewer samples
    # while nodes are missing ("elastic-batch"): the label of the policy's report rows.
    fixed_batch: bool = True
    # Steps between in-memory copies of every rank's state (own node and a peer node); 0: none.
    memory_every: int = 0

    @property
    def batch_label(self) -> str:
        return "fixed-batch" if self.fixed_batch else "elastic-batch"


def ours(planner: SimPlanner, elastic: ElasticConfig, memory_every: int = 0) -> Strategy:
    policy = ElasticPolicy(elastic, planner.plan_for)
    return Strategy(
        "ours",
        policy.decide,
        uses_notice=True,
        live_resize=False,
        cold_restart=False,
        samples_per_step=lambda lay: lay.global_batch,
        prestarts_actors=True,
        fixed_batch=planner.cfg.trainer.batch_tolerance == 0,
        memory_every=memory_every,
    )


def restart(full_layout: Layout, nodes_needed: int) -> Strategy:
    def decide(obs: Observation) -> Decision:
        if obs.layout is not None:
            return Noop("fixed size: ignores notices and new capacity")
        if len(obs.nodes) < nodes_needed:
            return Wait(f"fixed size: {len(obs.nodes)} of {nodes_needed} nodes")
        used = tuple(n.node_id for n in obs.nodes[:nodes_needed])
        return Resize(full_layout, used, f"restart at {full_layout.describe()}")

    return Strategy(
        "restart",
        decide,
        uses_notice=False,
        live_resize=False,
        cold_restart=True,
        samples_per_step=lambda lay: lay.global_batch,
    )


def dp_only(
    planner: SimPlanner, full_layout: Layout, gpus_per_node: int, memory_per_accelerator: float
) -> Strategy:
    """Replicas of the full layout's TP x CP x PP; each replica shards over `group` nodes."""
    per_rank = full_layout.micro_batch * full_layout.grad_accum  # samples per DP rank per step
    group = _replica_nodes(planner, full_layout, gpus_per_node, memory_per_accelerator)
    most = max(1, full_layout.dims.world_size // (group * gpus_per_node))  # the configured batch

    def layout_for(replicas: int) -> Layout:
        dims = _replica_dims(full_layout.dims, group * gpus_per_node, replicas)
        # Its batch is per_rank x dp, never padded: DP-only shrinks the batch instead.
        return dataclasses.replace(
            full_layout, dims=dims, zero_stage=3 if dims.dp_shard > 1 else 0, real_global_batch=0
        )

    def decide(obs: Observation) -> Decision:
        replicas = min(most, len(obs.nodes) // group)
        if obs.health == "notice":
            return Noop("DP-only: notices are not used")
        if replicas < 1:
            return Wait(f"DP-only: {len(obs.nodes)} nodes, a replica needs {group}")
        if obs.layout is not None and replicas * group <= len(obs.layout_nodes):
            return Noop()
        lay = layout_for(replicas)
        used = tuple(n.node_id for n in obs.nodes[: replicas * group])
        return Resize(lay, used, f"DP-only: {replicas} replicas of {group} nodes")

    return Strategy(
        "dp_only",
        decide,
        uses_notice=False,
        live_resize=True,
        cold_restart=False,
        samples_per_step=lambda lay: per_rank * lay.dims.dp,
        fixed_batch=False,
    )


def _replica_dims(full: ParallelDims, ranks_per_replica: int, replicas: int) -> ParallelDims:
    """`replicas` replicas of the full layout's tp x cp x pp, each sharding over the rest of
    `ranks_per_replica` ranks; its experts over as much of the full layout's ep as the shard
    group holds."""
    shard = ranks_per_replica // (full.tp * full.cp * full.pp)
    return ParallelDims(
        replicas * shard * full.tp * full.cp * full.pp,
        pp=full.pp,
        dp_replicate=replicas,
        dp_shard=shard,
        cp=full.cp,
        tp=full.tp,
        ep=math.gcd(full.ep, shard),
    )


def _replica_nodes(planner: SimPlanner, full: Layout, gpus_per_node: int, memory: float) -> int:
    """The fewest nodes on which one replica (ZeRO-3 inside it) fits in memory."""
    d = full.dims
    nodes_for_tp_pp = max(1, -(-d.tp * d.cp * d.pp // gpus_per_node))
    group = nodes_for_tp_pp
    while group * gpus_per_node <= full.dims.world_size:
        dims = _replica_dims(d, group * gpus_per_node, 1)
        shard = dims.dp_shard
        lay = dataclasses.replace(
            full, dims=dims, zero_stage=3 if shard > 1 else 0, real_global_batch=0
        )
        mem = estimate_memory(
            planner.shape, lay, seq_len=planner.cfg.data.seq_len, precision=planner.precision
        )
        if mem.total <= memory:
            return group
        group += nodes_for_tp_pp
    return max(1, full.dims.world_size // gpus_per_node)
