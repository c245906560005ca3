"""A scripted cluster and rank group for driving the coordinator without Ray or torch.

The fake ranks train one step per poll, save on schedule and on request (writing a file so the
real checkpoint store can commit it, and reporting its digest), verify their share of a
checkpoint before a formation as real ranks do, and can be told to die, hang or receive a
notice. A dead node's ranks report what Ray reports (the actor died with its node) and their
peers fail, as gloo peers do.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path

from raytrain_dt.checkpoint.digests import FileDigests, verify_files
from raytrain_dt.control.group import NODE_DIED, FormationFault, PlacementTimedOut
from raytrain_dt.topology.nodes import NodeInfo
from raytrain_dt.worker.reports import (
    Notice,
    RankReport,
    RankStatus,
    SavedReport,
    StepMetrics,
    StepReport,
    TrainStateReport,
)

ACCELERATORS_PER_NODE = 2
_actor_indices = itertools.count()


@dataclass
class FakeCluster:
    node_ids: list[str]
    drained: set[str] = field(default_factory=set)
    requests: list[list[dict]] = field(default_factory=list)

    def nodes(self) -> list[NodeInfo]:
        return [NodeInfo(n, ACCELERATORS_PER_NODE) for n in sorted(self.node_ids)]

    def draining(self) -> set[str]:
        return set(self.drained)

    def request_capacity(self, bundles: list[dict]) -> None:
        self.requests.append(bundles)


@dataclass
class FakeSlot:
    node_id: str
    actor_index: int = field(default_factory=lambda: next(_actor_indices))
    pid: int = 0
    state: str = "running"
    error: str | None = None
    notice: Notice | None = None
    # What in-memory copies name an actor by and call it through (`control/copy_holders.py`).
    actor_index: int = field(default_factory=lambda: next(_ACTOR_INDEXES))
    handle: object = None


_ACTOR_INDEXES = itertools.count()


class FakeRankGroup:
    def __init__(self, checkpoint_root: str):
        self.checkpoint_root = Path(checkpoint_root)
        self.slots: list[FakeSlot] = []
        self.idle: list[FakeSlot] = []
        self.starting: list[FakeSlot] = []  # warmed ahead of need: started at the next collect
        self.formations: list[dict[str, int]] = []
        self.dropped = 0
        self.hung = False
        self.setup_hangs = False  # the next `setup` never returns (its deadline passes)
        # The next `setup` loses this node (its actors die with it, as Ray reports).
        self.setup_loses_node: str | None = None
        # ... and a survivor's set-up raises first ("connection closed by peer"), before Ray
        # reports its peers' deaths: the fault is a raised call, not a dead actor.
        self.survivor_raises_first = False
        # The next `form` finds no room on this node within the placement time-out.
        self.placement_times_out_on: str | None = None
        self.torn_down: list[list[int]] = []  # the ranks of each `teardown` call
        # Each `teardown` call's (grace before the abort, time to return after it).
        self.teardown_times: list[tuple[float, float]] = []
        # Seconds between the steps' reported finishing times (None: the wall clock's).
        self.step_s: float | None = None
        self._step_clock = time.time()
        # Seconds the last step's save takes to write: its ranks report it written once that
        # has passed (later than the step, as a large final checkpoint), then finish.
        self.final_save_s = 0.0
        self._final_save_at: float | None = None  # time.time() its write ends
        self.set_up = False  # the formed layout's set-up succeeded: its ranks train
        self._stop_requested = False
        self.verified: list[set[str]] = []  # the files checked before each formation

    @property
    def world_size(self) -> int:
        return len(self.slots)

    # --- what the coordinator calls ----------------------------------------------------------
    def form(
        self, counts_by_node: dict[str, int], timeout_s: float, start_timeout_s: float | None = None
    ) -> None:
        if self.placement_times_out_on in counts_by_node:
            node, self.placement_times_out_on = self.placement_times_out_on, None
            raise PlacementTimedOut(f"cluster.placement_timeout_s: no room on node {node}", node)
        self.collect_warm()
        kept = [s for s in self.slots + self.idle if s.state != "dead"]
        self.slots = []
        for node, count in sorted(counts_by_node.items()):
            here = [s for s in kept if s.node_id == node][:count]
            self.slots += here + [FakeSlot(node) for _ in range(count - len(here))]
        self.idle = [s for s in kept if s not in self.slots]
        for slot in self.slots:
            slot.state, slot.error = "running", None
        self.formations.append(dict(counts_by_node))
        self.set_up = False

    def master_endpoint(self, timeout_s: float | None = None) -> tuple[str, int]:
        return "127.0.0.1", 1

    def setup(self, specs: list, timeout_s: float | None = None) -> list[dict]:
        if self.setup_hangs:
            raise TimeoutError(f"Get timed out: some object(s) not ready after {timeout_s}s")
        if self.setup_loses_node:
            node, self.setup_loses_node = self.setup_loses_node, None
            for slot in self.slots:
                if slot.node_id == node:
                    slot.state, slot.error = "dead", f"ActorDiedError: died {NODE_DIED}."
            if self.survivor_raises_first:
                detail = "RayTaskError(RuntimeError): Connection closed by peer"
                raise FormationFault(detail, actor_died=False)
            raise FormationFault(f"ActorDiedError on node {node}: {NODE_DIED}", frozenset({node}))
        spec = specs[0]
        self.step, self.end, self.every = (
            spec.start_step,
            spec.end_step,
            spec.cfg.checkpoint.every_steps,
        )
        self.consumed = spec.data.consumed_samples
        self.global_batch = spec.layout.global_batch
        self.hung, self._stop_requested, self.set_up = False, False, True
        return [
            {
                "process_group_s": 0.01,
                "model_build_s": 0.02,
                "checkpoint_load_s": 0.03,
                "data_start_s": 0.04,
            }
            for _ in self.slots
        ]

    def verify_checkpoint(
        self, uri: str, shares: list[dict[str, dict]], timeout_s: float | None = None
    ) -> list[list[str]]:
        # Each rank checks its share, as the real ones do.
        self.verified.append({name for files in shares for name in files})
        return [verify_files(uri, files) for files in shares]

    def start(self) -> None:
        pass

    def teardown(
        self,
        grace_s: float,
        timeout_s: float = 30.0,
        keep_save: bool = True,
        return_s: float = 0.0,
    ) -> list[int]:
        self.torn_down.append(list(range(len(self.slots))))
        self.teardown_times.append((grace_s, return_s))
        return []

    def request_checkpoint_and_stop(
        self, timeout_s: float = 30.0, memory_only: bool = False
    ) -> list[int]:
        self._stop_requested = True
        return []

    def drop(self, ranks: list[int]) -> None:
        self.dropped += len(ranks)
        self.slots = [s for r, s in enumerate(self.slots) if r not in ranks]

    def shutdown(self) -> None:
        self.slots, self.idle, self.starting = [], [], []

    def adopt_warm(self) -> int:
        return 0  # no driver's earlier run here

    def host_data_services(self) -> None:
        pass  # no Ray Data here

    def warm(self, node_id: str, count: int) -> None:
        self.starting += [FakeSlot(node_id) for _ in range(count)]

    def collect_warm(self, timeout_s: float = 0.0, give_up_s: float = 300.0) -> None:
        self.idle += self.starting
        self.starting = []

    def actors_on(self, node_id: str) -> int:
        return sum(s.node_id == node_id for s in self.slots + self.idle + self.starting)

    def starting_on(self, node_id: str) -> int:
        return sum(s.node_id == node_id for s in self.starting)

    def actor_count(self) -> int:
        return len(self.slots) + len(self.idle) + len(self.starting)

    def drop_spares(self, node_ids: set[str]) -> None:
        self.idle = [s for s in self.idle if s.node_id not in node_ids]
        self.starting = [s for s in self.starting if s.node_id not in node_ids]

    def poll(self, timeout_s: float = 30.0) -> list[RankStatus]:
        running = all(s.state == "running" for s in self.slots)
        reports = [[] for _ in self.slots]
        writing = self._final_save_at is not None
        if writing:
            if time.time() >= self._final_save_at:  # written; the ranks finish at the next poll
                self._save_written(reports)
                self._final_save_at = None
        elif running and self.set_up and not self.hung and self.step < self.end:
            self.step += 1
            self.consumed += self.global_batch
            for rank in range(self.world_size):
                reports[rank].append(self._step_report(rank))
            if (self.every and self.step % self.every == 0) or self._stop_requested:
                self._save_started(reports)
                if self.step == self.end and self.final_save_s and not self._stop_requested:
                    self._final_save_at = time.time() + self.final_save_s
                else:
                    self._save_written(reports)
            if self._stop_requested:
                for slot in self.slots:
                    slot.state = "done"
        if self.step == self.end and running and not writing and self._final_save_at is None:
            for slot in self.slots:
                slot.state = "done"
        return [
            RankStatus(r, s.state, reports[r], s.error, s.notice, s.node_id)
            for r, s in enumerate(self.slots)
        ]

    # --- what a test scripts -----------------------------------------------------------------
    def kill_node(self, node: str) -> None:
        for slot in self.slots:
            if slot.node_id == node:
                slot.state, slot.error = "dead", f"ActorDiedError: The actor died {NODE_DIED}."
            else:
                slot.state, slot.error = "failed", "RuntimeError: Connection closed by peer"

    def kill_rank(self, rank: int) -> None:
        for r, slot in enumerate(self.slots):
            if r == rank:
                slot.state = "dead"
                slot.error = (
                    "ActorDiedError: The actor is dead because its worker process has died."
                )
            else:
                slot.state, slot.error = "failed", "RuntimeError: Connection closed by peer"

    def notice(self, rank: int, source: str = "sigterm") -> None:
        self.slots[rank].notice = Notice(source, "scripted", 0.0)

    # --- internals ---------------------------------------------------------------------------
    def _step_report(self, rank: int) -> StepReport:
        metrics = None
        if rank == 0:
            metrics = StepMetrics(
                loss=1.0,
                lr=1e-3,
                grad_norm=1.0,
                step_time_s=0.01,
                data_wait_s=0.0,
                tokens_per_s=100.0,
            )
        if rank == 0 and self.step_s is not None:
            self._step_clock += self.step_s
        return StepReport(
            self.step,
            self.consumed,
            finished_at=time.time() if self.step_s is None else self._step_clock,
            mem_allocated_bytes=1,
            mem_peak_bytes=1,
            metrics=metrics,
        )

    def _save_started(self, reports: list[list[RankReport]]) -> None:
        train_state = {"step": self.step, "consumed_samples": self.consumed}
        reports[0].append(TrainStateReport(self.step, train_state))

    def _save_written(self, reports: list[list[RankReport]]) -> None:
        step_dir = self.checkpoint_root / f"step_{self.step}"
        step_dir.mkdir(parents=True, exist_ok=True)
        for rank in range(self.world_size):
            written = FileDigests()
            shard = f"shard_{rank}.bin"
            (step_dir / shard).write_bytes(b"x" * (rank + 1))
            written.add_bytes(shard, b"x" * (rank + 1))
            reports[rank].append(SavedReport(self.step, rank, str(step_dir), written.manifest()))


class FakeKV:
    """Ray's internal KV store (the GCS), as `observe/status.py` calls it."""

    def __init__(self):
        self.data: dict[tuple[str, str], str] = {}

    def _internal_kv_put(self, key, value, overwrite=True, namespace=None):
        self.data[(namespace, key)] = value

    def _internal_kv_get(self, key, namespace=None):
        return self.data.get((namespace, key))

    def _internal_kv_del(self, key, namespace=None):
        self.data.pop((namespace, key), None)

    def _internal_kv_list(self, prefix, namespace=None):
        return [k for ns, k in self.data if ns == namespace and k.startswith(prefix)]
