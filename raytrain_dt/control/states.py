"""The coordinator's states. Each carries its payload; `terminal` ends the loop.

starting -> running -> (draining -> resizing | restarting | waiting) -> running ... -> finished
Any state can go to failed. Transitions are logged to `events.jsonl` with their reasons.
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
    Starting | Running | Draining | Resizing | Restarting | Waiting | Finished | Stopped | Failed
)
