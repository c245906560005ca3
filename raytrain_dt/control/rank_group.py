"""The rank group: rank actors in a node-shaped placement group, and calls fanned out to them.

It is the only place the coordinator touches Ray actors. Ray's errors for dead actors and
nodes propagate from `poll` at once, so failure detection does not wait for a deadline.
"""

from __future__ import annotations

import contextlib
import logging

from raytrain_dt.control.placement import assign_ranks, ranks_per_node
from raytrain_dt.errors import UserError

log = logging.getLogger(__name__)


class RankGroup:
    def __init__(
        self, run_dir: str, resource: str, cpus_per_rank: float, runtime_env: dict | None = None
    ):
        self.run_dir = run_dir
        self.resource = resource
        self.cpus_per_rank = cpus_per_rank
        self.runtime_env = runtime_env or {}
        self.pg = None
        self.actors: list = []  # ordered by rank after start()
        self.placement: list[dict] = []  # per rank: node_id, ip, pid, port

    def _actor_options(self) -> dict:
        if self.resource == "CPU":
            return {"num_cpus": 1}
        if self.resource == "GPU":
            return {"num_gpus": 1, "num_cpus": self.cpus_per_rank}
        return {"num_cpus": self.cpus_per_rank, "resources": {self.resource: 1}}

    def _bundle(self, count: int) -> dict:
        per_rank = self._actor_options()
        bundle = {"CPU": per_rank.get("num_cpus", 0) * count}
        if self.resource == "GPU":
            bundle["GPU"] = count
        elif self.resource != "CPU":
            bundle[self.resource] = count
        return {k: v for k, v in bundle.items() if v}

    def start(self, world_size: int, node_capacities: list[int], tp: int, timeout_s: float) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from raytrain_dt.worker.rank_actor import RankWorker

        counts = ranks_per_node(world_size, node_capacities, tp)
        self.pg = placement_group([self._bundle(c) for c in counts], strategy="STRICT_SPREAD")
        try:
            ray.get(self.pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as exc:
            ray.util.remove_placement_group(self.pg)
            raise UserError(
                f"cluster.placement_timeout_s: no room for {world_size} ranks as {counts} per node "
                f"on {self.resource} within {timeout_s:.0f}s"
            ) from exc
        actor_cls = ray.remote(RankWorker)
        actors = []
        for bundle_index, count in enumerate(counts):
            for _ in range(count):
                actors.append(
                    actor_cls.options(
                        **self._actor_options(),
                        runtime_env=self.runtime_env or None,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            placement_group=self.pg, placement_group_bundle_index=bundle_index
                        ),
                    ).remote(self.run_dir, len(actors))
                )
        reports = ray.get([a.where.remote() for a in actors])
        ranks = assign_ranks(reports)
        self.actors = [None] * len(actors)
        self.placement = [{}] * len(actors)
        for position, rank in enumerate(ranks):
            self.actors[rank] = actors[position]
            self.placement[rank] = reports[position]
        log.info("placed %d ranks on %d nodes as %s", world_size, len(counts), counts)

    @property
    def master(self) -> tuple[str, int]:
        return self.placement[0]["ip"], self.placement[0]["port"]

    def call(
        self, method: str, per_rank_args: list[tuple] | None = None, timeout_s: float | None = None
    ):
        """Call `method` on every rank concurrently (collectives need all ranks in) and wait."""
        import ray

        refs = [
            getattr(actor, method).remote(*(per_rank_args[rank] if per_rank_args else ()))
            for rank, actor in enumerate(self.actors)
        ]
        return ray.get(refs, timeout=timeout_s)

    def poll(self, timeout_s: float = 60.0) -> list[dict]:
        return self.call("poll", timeout_s=timeout_s)

    def shutdown(self) -> None:
        import ray

        for actor in self.actors:
            with contextlib.suppress(Exception):  # already dead
                ray.kill(actor)
        if self.pg is not None:
            ray.util.remove_placement_group(self.pg)
        self.actors, self.pg = [], None
