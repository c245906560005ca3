"""Deciding, apart from executing: turn a due decision (`Deciding`, returned by a handler or
by the loop for starting and waiting) into the next state. Observe the cluster, ask the
elastic policy, record the decision and time it (`control/recovery_timing.py`), and map it
to a state: resizing, restarting, draining, waiting, running or failed. Nothing here touches
the group; the handlers of those states do.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from raytrain_dt.control.policies import (
    ElasticPolicy,
    Fail,
    Noop,
    Observation,
    Resize,
    Wait,
)
from raytrain_dt.control.run_state import RunState
from raytrain_dt.control.states import (
    Deciding,
    Draining,
    Failed,
    Resizing,
    Restarting,
    Running,
    State,
    Waiting,
)
from raytrain_dt.observe.metrics import RunRecorder

log = logging.getLogger("raytrain_dt.control.coordinator")


@dataclass
class Decider:
    policy: ElasticPolicy
    run: RunState
    recorder: RunRecorder
    # observe(health): the cluster and the group as the policy sees them now.
    observe: Callable[[str], Observation]

    def decide(self, deciding: Deciding) -> State:
        """Turn a due decision into the next state: observe, ask the policy, act on it."""
        run = self.run
        if deciding.drained is not None:
            # After a drain, re-plan without the old layout: the node under notice may be
            # gone, or the capacity may have changed.
            decision = self.policy.decide(replace(self.observe("ok"), layout=None))
            if isinstance(decision, Resize):
                return Resizing(replace(decision, reason=deciding.drained.reason))
        obs = self.observe(deciding.health)
        waiting = deciding.waiting
        if waiting is not None:
            obs = replace(obs, waiting_since=waiting.since)
        started = time.perf_counter()
        decision = self.policy.decide(obs)
        if isinstance(decision, Resize):
            if decision.checkpoint_first and not run.draining:
                # Growth: since the nodes appeared, or since the failure that shrank the group
                # (a grow back onto a dead rank's warmed replacement), whichever is later.
                appeared = started - (time.time() - run.nodes_since)
                run.incident.cause(max(appeared, run.shrunk_at))
            run.incident.decided(started, time.perf_counter())
        if not isinstance(decision, Noop):
            self.recorder.event(
                "decision",
                decision=type(decision).__name__.lower(),
                reason=decision.reason,
                health=obs.health,
                step=obs.step,
            )
            log.info("decision: %s", decision.reason)
        if isinstance(decision, Fail):
            return Failed(decision.reason)
        if isinstance(decision, Wait):
            if waiting is None:
                log.warning("waiting: %s", decision.reason)
            time.sleep(1.0)
            return Waiting(decision.reason, waiting.since if waiting else obs.now)
        if isinstance(decision, Resize):
            if decision.checkpoint_first and run.layout is not None:
                return Draining(decision)
            return Restarting(decision) if obs.health in ("failed", "hung") else Resizing(decision)
        time.sleep(deciding.pause_s)
        return Running()
