"""The simulation's event loop: trace events (notices, losses, arrivals), chaos actions fired by
step, timers (detection, drain, formation, stability checks), over a `GroupModel`.

Events are taken in time order; between them nothing happens but training, which the current
`Segment` computes in closed form. The policy is asked whenever its answer can change: on a
failure, a notice, a node joining, and once the node set has been stable for
`elastic.grow_stable_s` (the coordinator asks every 0.5 s; a pure policy answers the same).
"""

from __future__ import annotations

import heapq
import math

from raytrain_dt.control.placement import counts_by_node
from raytrain_dt.sim.group_model import GroupModel, SimResult, node_index, node_name
from raytrain_dt.sim.trace import DOWN, NOTICE, UP, Trace


class Simulation(GroupModel):
    # --- cluster events ----------------------------------------------------------------------
    def _down(self, node: int, drained: bool = False) -> None:
        if node not in self.alive:
            return
        self.alive.discard(node)
        self.warm_at.pop(node, None)
        self.actor_nodes.discard(node_name(node))  # its actors, used or idle, are gone
        self.draining.discard(node)
        self.lost.discard(node)
        self._nodes_changed()
        name = node_name(node)
        in_group = (
            name in self.forming.nodes if self.phase == "forming" else node in self.layout_ints
        )
        if in_group and not drained and self.phase in ("running", "draining", "forming"):
            self._fail()
        elif self.phase == "idle":
            # While running, losing an unused node changes no decision: the node set just
            # became unstable, and the stability check above asks the policy again.
            self._decide("ok")

    def _up(self, node: int) -> None:
        if node in self.alive:
            return
        self.alive.add(node)
        if self.strategy.prestarts_actors and self.result.formations:
            self.warm_at[node] = self.t + self.costs.actor_start_s
            self._timer(self.costs.actor_start_s, "warm", node)
        self._nodes_changed()
        if self.phase in ("running", "idle"):
            self._decide("ok")

    def _notice(self, node: int) -> None:
        if node not in self.alive or not self.strategy.uses_notice:
            return
        self.draining.add(node)
        self._usable_cache = None
        self.result.notice_times.append(self.t)
        if self.phase in ("running", "idle"):
            self._decide("ok")

    def _node_of_rank(self, rank: int) -> int:
        counts = counts_by_node(
            self.layout.dims.world_size,
            self.layout.dims.tp,
            [(n, self.gpus_per_node) for n in self.layout_nodes],
        )
        for name in sorted(counts):
            if rank < counts[name]:
                return node_index(name)
            rank -= counts[name]
        return node_index(max(counts))

    def _fire_step_actions(self) -> None:
        s = self.seg.steps_at(self.t)
        due = [(i, a) for i, a in self.pending if a.at_step <= s]
        self.pending = [(i, a) for i, a in self.pending if a.at_step > s]
        for _, action in due:
            if action.action == "add_node":
                self.next_node += 1
                self._timer(self.costs.arrival_lag_s, "up", self.next_node - 1)
            elif self.phase == "running":
                node = self._node_of_rank(action.target)
                if action.action == "kill_node":
                    self._down(node)
                else:
                    self.preempting[node] = 1
                    self._notice(node)

    # --- the event loop ----------------------------------------------------------------------
    def _on_timer(self, kind: str, gen: int, payload) -> None:
        if kind == "check":
            if self.phase in ("running", "idle") and payload in (self._check_due, self.t):
                self._decide("ok")
        elif kind == "up":
            self._up(payload)
        elif kind == "warm":
            self._usable_cache = None
            if payload in self.alive and self.phase in ("running", "idle"):
                self._decide("ok")
        elif gen != self.gen:
            return  # a later state change made this one moot
        elif kind == "detected":
            self.phase = "detected"
            self._decide("failed")
        elif kind == "drained":
            self._drained(*payload)
        elif kind == "formed":
            self._formed(payload)
        elif kind == "joined" and self.phase == "running":
            usable = {n.node_id for n in self._usable()}
            if set(payload.nodes) <= usable:
                self._live_resize(payload, joined=True)

    def _on_trace(self, kind: int, node: int) -> None:
        if kind == NOTICE:
            self._notice(node)
        elif kind == DOWN:
            self._down(node)
        elif kind == UP:
            if self.costs.arrival_lag_s:
                self._timer(self.costs.arrival_lag_s, "up", node)
            else:
                self._up(node)

    def run(self) -> SimResult:
        trace = self.trace if isinstance(self.trace, Trace) else None
        i, n = 0, len(trace) if trace is not None else 0
        self._decide("ok")
        finished = False
        while self.phase != "failed":
            t_trace = float(trace.t[i]) if i < n else math.inf
            t_timer = self.timers[0][0] if self.timers else math.inf
            t_step = t_finish = math.inf
            if self.phase == "running":
                if self.pending:
                    t_step = self.seg.time_of(min(a.at_step for _, a in self.pending))
                if self.total_steps is not None:  # formed at the last step: done at once
                    done = self.seg.s0 >= self.total_steps
                    t_finish = self.t if done else self.seg.time_of(self.total_steps)
            t = max(self.t, min(t_trace, t_timer, t_step, t_finish))
            if t >= self.duration or t == math.inf:
                break
            self.held_node_s += len(self.alive) * (t - self.t)
            self.t = t
            if t_finish <= t:
                finished = True
                break
            if t_trace <= t:
                self._on_trace(int(trace.kind[i]), int(trace.node[i]))
                i += 1
            elif t_timer <= t:
                _, _, kind, gen, payload = heapq.heappop(self.timers)
                self._on_timer(kind, gen, payload)
            else:
                self._fire_step_actions()
        end = self.t if finished or self.duration == math.inf else self.duration
        self.held_node_s += len(self.alive) * (end - self.t)
        self.t = end
        self._close_segment(end, in_flight_lost=False)
        r = self.result
        r.wall_s, r.steps, r.samples = end, self.step, self.samples
        r.down_s = end - self.run_s
        r.gpu_hours_held = self.held_node_s * self.gpus_per_node / 3600
        return r
