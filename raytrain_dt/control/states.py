"""The coordinator's states. Each carries its payload; `terminal` ends the loop.

                  +------------------ waiting <-----------------+
                  v                                             |
    starting -> [deciding] -> resizing | restarting -> running -+-> finished
                  ^   |                                  |  |
                  |   +-> draining (checkpoint first) <--+  +-> [deciding] (a failure: "failed"
                  |          |                                 or "hung"; a periodic check)
                  +----------+ (drained: re-plan)

Handlers execute a state and return the next one; none decides. Where a decision is due they
return `Deciding`, which the loop turns into a decision (`ElasticPolicy.decide`) at once, in
the same iteration: resizing, restarting, draining, waiting, running or failed. So `Deciding`
is never the state between two iterations, and never logged. A stop request (SIGTERM) leads to
draining, then stopped. Any state can go to failed. Transitions are logged to `events.jsonl`
with their reasons.
"""

from __future__ import annotations

from dataclasses import dataclass

from raytrain_dt.control.policies import Resize


@dataclass(frozen=True)
class Starting:
    terminal = False


@dataclass(frozen=True)
class Running:
    terminal = False


@dataclass(frozen=True)
class Draining:
    """Checkpoint at the next step boundary and stop there, then resize (no step lost)."""

    decision: Resize
    terminal = False


@dataclass(frozen=True)
class Resizing:
    """Re-form a healthy, drained group at a new layout."""

    decision: Resize
    terminal = False


@dataclass(frozen=True)
class Restarting:
    """Re-form after a failure, from the latest committed checkpoint."""

    decision: Resize
    terminal = False


@dataclass(frozen=True)
class Waiting:
    reason: str
    since: float
    terminal = False


@dataclass(frozen=True)
class Deciding:
    """A decision is due: ask the policy, with the group's health as the handler saw it."""

    health: str  # "ok", "notice", "failed" or "hung" (`Observation.health`)
    waiting: Waiting | None = None  # the wait this decision ends, if any (its start time)
    # A drain has finished for this decision: re-plan without the old layout first.
    drained: Resize | None = None
    # A running group that stays as it is pauses this long before its next poll.
    pause_s: float = 0.0
    terminal = False


@dataclass(frozen=True)
class Finished:
    step: int
    terminal = True


@dataclass(frozen=True)
class Stopped:
    """Asked to stop (SIGTERM, `ray job stop`): checkpointed at a step boundary, resumable."""

    step: int
    reason: str
    terminal = True


@dataclass(frozen=True)
class Failed:
    reason: str
    terminal = True


State = (
    Starting
    | Running
    | Deciding
    | Draining
    | Resizing
    | Restarting
    | Waiting
    | Finished
    | Stopped
    | Failed
)
