"""The simulated coordinator executing one policy's decisions (`GroupModel`); the event loop that
drives it over a trace is `sim/loop.py` (`Simulation`).

The flow mirrors `control/coordinator.py` state by state: a failure (a used node DOWN without a
drain, also while the group forms) is seen after `detection_s`, the policy is asked with health
"failed" and no layout, and the group re-forms from the newest in-memory copy whose every shard
still has a holder (with `Strategy.memory_every`), else from the newest committed checkpoint;
a notice makes the policy return a
`Resize(checkpoint_first)`, the group saves at the next step boundary (a JIT checkpoint), the
noticed nodes are excluded (the coordinator's `lost_nodes`), and the policy is asked again with
no layout (with in-memory copies the state is handed over in memory, not saved); new capacity is offered to the policy once stable for `elastic.grow_stable_s`.
Actors outlive the layouts that leave them out: the coordinator keeps started actors idle
(`RankGroup.idle`) and, once formed, starts actors ahead of need on every usable node
(`Capacity.warm`), so a later formation on those nodes pays no actor start.
Decisions come only from the strategy's `decide` (for `ours`: the real `ElasticPolicy`).
Between events training advances in closed form (`Segment`), so cost grows with events, not steps.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from raytrain_dt.control.policies import Fail, FailureStreak, Observation, Resize, Wait
from raytrain_dt.sim.costs import Costs
from raytrain_dt.sim.segment import Segment
from raytrain_dt.sim.sim_planner import SimPlanner
from raytrain_dt.sim.strategies import Strategy
from raytrain_dt.sim.trace import StepTrace, Trace


def node_name(index: int) -> str:
    """The simulated node's id, as the planner and the policy see it."""
    return f"n{index:05d}"


def node_index(name: str) -> int:
    return int(name[1:])


@dataclass
class SimResult:
    policy: str
    ckpt_every: int
    wall_s: float
    steps: int
    samples: int
    steps_lost: int = 0
    lost_compute_s: float = 0.0
    down_s: float = 0.0  # no training (detection, waiting, draining, forming)
    degraded_s: float = 0.0  # training slower than the best layout
    gpu_hours_held: float = 0.0  # every alive node, used or not (what a spot bill counts)
    failures: int = 0
    drains: int = 0
    formations: list[dict] = field(default_factory=list)
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (t, samples, gpus)
    failed: str | None = None
    batch: str = "fixed-batch"  # the policy's label: fixed-batch or elastic-batch
    memory_restores: int = 0  # re-formations restored from in-memory copies
    notice_times: list[float] = field(default_factory=list)  # when the policy saw each notice


@dataclass
class GroupModel:
    """The run's state (nodes, group, progress, checkpoints) and the execution of decisions."""

    strategy: Strategy
    trace: Trace | StepTrace
    planner: SimPlanner
    costs: Costs
    gpus_per_node: int
    ckpt_every: int
    best_samples_per_s: float
    grow_stable_s: float
    wait_timeout_s: float
    total_steps: int | None = None  # stop when reached (the validation run); None: run the trace

    def __post_init__(self) -> None:
        is_steps = isinstance(self.trace, StepTrace)
        self.duration = math.inf if is_steps else self.trace.duration_s
        self.t, self.phase, self.gen = 0.0, "idle", 0
        self.alive = set(range(self.trace.nodes))
        self.draining: set[int] = set()
        self.lost: set[int] = set()  # drained nodes, excluded until they are gone
        self.actor_nodes: set[str] = set()
        self.warm_at: dict[int, float] = {}  # joined nodes whose actors start ahead of need
        self._forming_new_actors = False  # whether the formation under way starts actors
        self.layout, self.layout_nodes, self.layout_ints = None, (), frozenset()
        self.seg: Segment | None = None
        self.step = self.samples = 0
        self.ckpt = (0, 0)  # (step, samples) of the newest committed checkpoint
        # (step, samples, layout nodes) of the newest complete in-memory copy; None: none.
        self.mem: tuple[int, int, tuple[str, ...]] | None = None
        self.restarts, self.streak = 0, FailureStreak()
        self.nodes_since, self.waiting_since = 0.0, None
        self.timers: list = []
        self.seq = 0
        self.pending = list(enumerate(self.trace.actions)) if is_steps else []
        self.preempting: dict[int, int] = {}
        self.next_node = self.trace.nodes
        self._usable_cache = None
        self._infos: dict = {}
        self._check_due = math.inf
        self._last_step_s = 0.0
        self.run_s = self.held_node_s = 0.0
        self.result = SimResult(
            self.strategy.name, self.ckpt_every, 0.0, 0, 0, batch=self.strategy.batch_label
        )

    # --- bookkeeping -------------------------------------------------------------------------
    def _timer(self, delay: float, kind: str, payload=None) -> None:
        self.seq += 1
        heapq.heappush(self.timers, (self.t + delay, self.seq, kind, self.gen, payload))

    def _info(self, node: int):
        if node not in self._infos:
            self._infos[node] = self.planner.node(node_name(node), self.gpus_per_node)
        return self._infos[node]

    def _usable(self) -> tuple:
        if self._usable_cache is None:
            alive = self.alive - self.lost
            # As `_warm_capacity`: a node whose actors are still starting is not shown while
            # other capacity can train (the "warm" timer asks the policy again).
            ready = {i for i in alive if self.warm_at.get(i, 0.0) <= self.t}
            self._usable_cache = tuple(self._info(i) for i in sorted(ready or alive))
        return self._usable_cache

    def _nodes_changed(self) -> None:
        self._usable_cache = None
        self.nodes_since = self.t
        # Growth is offered once the node set has been stable (only the newest check counts).
        self._check_due = self.t + self.grow_stable_s
        self._timer(self.grow_stable_s, "check", self._check_due)

    def _observe(self, health: str, with_layout: bool = True) -> Observation:
        return Observation(
            now=self.t,
            nodes=self._usable(),
            draining=frozenset(node_name(i) for i in self.draining),
            layout=self.layout if with_layout else None,
            layout_nodes=self.layout_nodes,
            health=health,
            step=self._progress()[0],
            restarts=self.restarts,
            failures_at_step=self.streak.count,
            waiting_since=self.waiting_since,
            nodes_stable_since=self.nodes_since,
        )

    def _progress(self) -> tuple[int, int]:
        if self.seg is None:
            return self.step, self.samples
        s = self.seg.steps_at(self.t)
        return s, self.seg.samples_at(s)

    def _close_segment(self, until: float, in_flight_lost: bool = True) -> None:
        """Training stops at `until`: progress and committed checkpoints up to then are kept;
        the step in flight is lost (not at the end of the trace, nor at a step boundary)."""
        seg, self.seg = self.seg, None
        if seg is None:
            return
        until = max(until, seg.t0)
        self.step = seg.steps_at(until)
        self.samples = seg.samples_at(self.step)
        committed = seg.committed_at(until)
        if committed is not None and committed > self.ckpt[0]:
            self.ckpt = (committed, seg.samples_at(committed))
        every = self.strategy.memory_every
        if every:  # each completed copy step's state is in host memory, own node and a peer's
            copied = max(seg.s0, self.step // every * every)
            self.mem = (copied, seg.samples_at(copied), self.layout_nodes)
        ran = until - seg.t0
        self.run_s += ran
        if seg.samples_per_step / seg.step_s < self.best_samples_per_s * (1 - 1e-9):
            self.result.degraded_s += ran
        if in_flight_lost:
            self.result.lost_compute_s += until - min(until, seg.time_of(self.step))
        self.result.timeline.append((until, self.samples, 0))

    # --- decisions, as the coordinator executes them -----------------------------------------
    def _decide(self, health: str = "ok") -> None:
        decision = self.strategy.decide(self._observe(health))
        if isinstance(decision, Fail):
            self._close_segment(self.t)
            self.phase, self.result.failed = "failed", decision.reason
        elif isinstance(decision, Wait):
            if self.phase != "idle" or self.waiting_since is None:
                self.phase, self.waiting_since = "idle", self.t
            due = self.waiting_since + self.wait_timeout_s
            if due < math.inf:
                self._timer(max(0.0, due - self.t), "check", due)
        elif isinstance(decision, Resize):
            self.waiting_since = None
            if decision.checkpoint_first and self.phase == "running":
                self._drain(decision)
            elif self.strategy.live_resize and self.phase in ("running", "detected"):
                self._live_resize(decision)
            else:
                self._form(decision)

    def _drain(self, decision: Resize) -> None:
        """Save at the next step boundary, commit, then ask the policy again without a layout."""
        self.result.drains += 1
        boundary = self.seg.steps_at(self.t) + 1
        self.seg.stop_step = boundary
        # With in-memory copies the state stays in memory, unless the noticed nodes take every
        # holder of some shard with them: then it is saved to storage as without copies.
        staying = {node_name(i) for i in self.alive - self.draining}
        in_memory = self.strategy.memory_every and self._copies_survive(self.layout_nodes, staying)
        if in_memory:
            handover = self.costs.memory_copy_s
        else:
            handover = self.planner.save_s(self.costs, len(self.layout_nodes))
        done = self.seg.time_of(boundary) + handover
        self.phase, self.gen = "draining", self.gen + 1
        self._timer(done - self.t, "drained", (decision, boundary, in_memory))

    def _drained(self, decision: Resize, boundary: int, in_memory: bool = False) -> None:
        self._close_segment(self.seg.time_of(boundary))
        if in_memory:
            self.mem = (self.step, self.samples, self.layout_nodes)
        else:
            self.ckpt = (self.step, self.samples)
        for node in list(self.preempting):  # a chaos preemption reclaims the node now
            self._down(node, drained=True)
        self.preempting.clear()
        self.lost |= self.draining
        self.draining.clear()
        self._nodes_changed()
        self.phase = "idle"
        fresh = self.strategy.decide(self._observe("ok", with_layout=False))
        if isinstance(fresh, Resize):
            self._form(Resize(fresh.layout, fresh.nodes, decision.reason))
        else:
            self._decide("ok")

    def _form(self, decision: Resize) -> None:
        """(Re)form the group from the newest state that survives: in memory, else durable."""
        self._close_segment(self.t)
        in_memory = self._roll_back()
        c = self.costs
        new_nodes = {node_index(n) for n in set(decision.nodes) - self.actor_nodes}
        load = c.memory_restore_s if in_memory else self.planner.load_s(c, len(decision.nodes))
        new_actors = self.strategy.cold_restart or bool(new_nodes)
        reform = (
            c.new_actor_reform_s if new_actors and c.new_actor_reform_s is not None else c.reform_s
        )
        cost = c.replan_s + reform + load
        if self.strategy.cold_restart:
            cost += c.actor_start_s
        elif new_nodes:  # pre-started actors cost only what is left of their start, if any
            left = max(self.warm_at.get(i, self.t + c.actor_start_s) - self.t for i in new_nodes)
            cost += max(0.0, left)
        self.phase, self.gen = "forming", self.gen + 1
        self.forming = decision
        self._forming_new_actors = new_actors
        self._timer(cost, "formed", decision)

    def _roll_back(self) -> bool:
        """Back to the newest in-memory copy whose every shard has a living holder (True), or
        to the newest committed checkpoint; the steps after it are lost."""
        target, in_memory = self.ckpt, False
        alive = {node_name(i) for i in self.alive}
        if self.mem and self.mem[0] >= target[0] and self._copies_survive(self.mem[2], alive):
            target, in_memory = self.mem[:2], True
        self.result.steps_lost += self.step - target[0]
        self.result.lost_compute_s += (self.step - target[0]) * self._last_step_s
        self.step, self.samples = target
        self.result.memory_restores += in_memory
        return in_memory

    @staticmethod
    def _copies_survive(nodes: tuple[str, ...], alive: set[str]) -> bool:
        """Whether every shard of a layout on `nodes` keeps a holder among `alive`: a rank's
        copy lives on its own node and on the next node of the layout (a peer node)."""
        n = len(nodes)
        return all(nodes[k] in alive or (n > 1 and nodes[(k + 1) % n] in alive) for k in range(n))

    def _formed(self, decision: Resize) -> None:
        kind = "start" if not self.result.formations else "resize"
        self.layout, self.layout_nodes = decision.layout, decision.nodes
        self.layout_ints = frozenset(node_index(n) for n in decision.nodes)
        # Actors of nodes the layout leaves out stay, idle (`RankGroup.idle`).
        self.actor_nodes |= set(decision.nodes)
        if self.strategy.memory_every:  # the restored state is the new layout's
            self.mem = (self.step, self.samples, decision.nodes)
        if self.strategy.prestarts_actors and kind == "start":
            # `Capacity.warm`: once formed, actors start on every usable node (on later
            # arrivals too: `Simulation._up`).
            for node in sorted(self.alive - self.lost):
                if node_name(node) not in self.actor_nodes and node not in self.warm_at:
                    self.warm_at[node] = self.t + self.costs.actor_start_s
                    self._timer(self.costs.actor_start_s, "warm", node)
        # As the coordinator does: chaos actions at or before the resumed step have fired.
        self.pending = [(i, a) for i, a in self.pending if a.at_step > self.step]
        self._start_segment(self.t + self._first_step_extra_s(), kind, decision.reason)
        self._decide("ok")  # what changed while forming (a notice, new nodes) is seen now

    def _first_step_extra_s(self) -> float:
        """What the formed group's first step costs beyond a normal one: more where it started
        actors (`Costs.new_actor_first_step_extra_s`)."""
        c = self.costs
        if self._forming_new_actors and c.new_actor_first_step_extra_s is not None:
            return c.new_actor_first_step_extra_s
        return c.first_step_extra_s

    def _start_segment(self, t0: float, kind: str, reason: str) -> None:
        lay = self.layout
        step_s = self.planner.step_s(lay, self.costs, self.gpus_per_node)
        self._last_step_s = step_s
        self.seg = Segment(
            t0,
            self.step,
            step_s,
            self.samples,
            self.strategy.samples_per_step(lay),
            lay.dims.world_size,
            self.ckpt_every,
            self.planner.stall_s(self.costs, lay.dims.world_size),
            self.planner.save_s(self.costs, len(self.layout_nodes)),
        )
        self.phase, self.gen = "running", self.gen + 1
        self.result.formations.append(
            {
                "t": self.t,
                "step": self.step,
                "kind": kind,
                "world": lay.dims.world_size,
                "nodes": len(self.layout_nodes),
                "layout": lay.as_dict(),
                "describe": lay.describe(),
                "step_s": step_s,
                "reason": reason,
            }
        )
        self.result.timeline.append((t0, self.samples, lay.dims.world_size))

    def _live_resize(self, decision: Resize, joined: bool = False) -> None:
        """DP-only: survivors keep their state; joining replicas first copy it from a peer
        (beside training while it runs; the survivors wait for it after a failure)."""
        joining = bool(set(decision.nodes) - self.actor_nodes) and not joined
        if self.phase == "running" and joining:
            self._timer(self.costs.dp_join_s, "joined", decision)
            return
        self._close_segment(self.t, in_flight_lost=False)  # quorums change at step boundaries
        delay = self.costs.dp_reconfigure_s + (self.costs.dp_join_s if joining else 0.0)
        self.layout, self.layout_nodes = decision.layout, decision.nodes
        self.layout_ints = frozenset(node_index(n) for n in decision.nodes)
        self.actor_nodes = set(decision.nodes)
        self.ckpt = (self.step, self.samples)  # nothing to roll back to: state lives on
        self._start_segment(self.t + delay, "resize", decision.reason)

    def _fail(self) -> None:
        self.result.failures += 1
        self._close_segment(self.t)
        self.streak.failed(self.step, training_fault=False)  # only nodes fail here
        self.restarts += 1
        # What was not saved died with the group: rolled back now, or (with in-memory copies)
        # at the re-formation, once it is known which holders of the copies are left.
        if not self.strategy.live_resize and not self.strategy.memory_every:
            self._roll_back()
        self.actor_nodes &= {node_name(i) for i in self.alive}
        self.layout, self.layout_nodes, self.layout_ints = None, (), frozenset()
        self.phase, self.gen = "detecting", self.gen + 1
        self._timer(self.costs.detection_s, "detected")
