"""What a rank tells the coordinator: its reports (a step trained, a checkpoint staged, saved
or failed, the loop stopped) and the status every health poll answers with.

One module for both sides, so the rank that writes a message and the coordinator that reads
it cannot disagree on its fields. The driver imports it, so it imports no torch; Ray pickles
these dataclasses between the processes. Where a report ends up in `metrics.jsonl` or
`events.jsonl`, `as_record` gives the same flat dict the files have always held.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

# The rank actor's Ray concurrency group for its health polls and its teardown: they are
# answered while a set-up runs (which may be waiting on a peer that died).
CONTROL_GROUP = "control"


@dataclass(frozen=True)
class StepMetrics:
    """Rank 0's view of a step (the other ranks send memory only)."""

    loss: float
    lr: float
    grad_norm: float
    step_time_s: float
    data_wait_s: float
    tokens_per_s: float
    mfu: float | None = None  # None where the accelerator's peak FLOP/s is unknown
    # Samples the step trained: the layout's real global batch (smaller than
    # trainer.global_batch under a batch tolerance). None only from test fakes.
    global_batch: int | None = None
    # Mixture-of-experts models: the step's router statistics over the global batch (summed
    # over MoE layers): {"tokens_per_expert": token copies each expert accepted, "dropped":
    # copies refused for capacity, "drop_rate": their share of all routed copies}.
    router: dict | None = None


@dataclass(frozen=True)
class StepReport:
    """Every rank, after every optimizer step."""

    step: int  # the step just completed (1-based)
    consumed_samples: int
    # When the step ended on the rank: the driver times steps by it (hang deadlines), free of
    # its own polling interval.
    finished_at: float
    # This rank's memory (`accel.device.memory_usage`); None where the loop measures none.
    mem_allocated_bytes: int | None = None
    mem_peak_bytes: int | None = None
    host_rss_peak_bytes: int | None = None
    metrics: StepMetrics | None = None  # rank 0 only
    # The samples this DP group trained on (one rank per DP group sends them: the ledger).
    sample_ids: list[int] | None = None

    def as_record(self) -> dict:
        """The flat dict `RunRecorder.rank_step` and `step_metrics` take (and metrics.jsonl
        holds): the fields that are set, the metrics inlined."""
        record = {k: v for k, v in asdict(self).items() if k != "metrics" and v is not None}
        if self.metrics is not None:
            record.update({k: v for k, v in asdict(self.metrics).items() if v is not None})
        return record


@dataclass(frozen=True)
class TrainStateReport:
    """Rank 0, at a save: the run's state at that step (the checkpoint record's body)."""

    step: int
    train_state: dict


@dataclass(frozen=True)
class CheckpointStagedReport:
    """A save's blocking part is done on this rank: `stall_s` is what training waited."""

    step: int
    stall_s: float


@dataclass(frozen=True)
class SavedReport:
    """This rank's shards of a save are written; `files`: name -> size and SHA-256."""

    step: int
    rank: int
    path: str
    files: dict[str, dict]


@dataclass(frozen=True)
class SaveFailedReport:
    """This rank's part of a save failed: that checkpoint is not committed, the run goes on."""

    step: int
    rank: int
    error: str


@dataclass(frozen=True)
class MemoryCopyReport:
    """This rank's in-memory copy of its state after `step` is complete (`worker/peer_copies.py`):
    held by the actors `holders` (its own first, then its peer's where the transfer finished).
    `files`: name -> size; `train_state`: the checkpoint record's body (rank 0 only)."""

    generation: int  # the formation whose ranks wrote it (rank numbers are that layout's)
    step: int
    rank: int
    holders: tuple[int, ...]  # actor indexes
    files: dict[str, int]
    train_state: dict | None = None
    copy_s: float = 0.0  # staging to the peer's acknowledgement, in the background
    skipped: int = 0  # boundaries so far in this layout whose copy every rank skipped (busy)


@dataclass(frozen=True)
class StoppedReport:
    """The loop ended at a step boundary as asked (drain), after that step's save."""

    step: int


RankReport = (
    StepReport
    | TrainStateReport
    | CheckpointStagedReport
    | SavedReport
    | SaveFailedReport
    | MemoryCopyReport
    | StoppedReport
)


@dataclass(frozen=True)
class Notice:
    """A preemption notice a rank saw for its node (SIGTERM, the cloud's spot notice)."""

    source: str
    detail: str
    time: float


# "dead" (the actor or its node died) and "unresponsive" (its poll timed out) are set by the
# driver's `RankGroup.poll`; the rank itself answers the others.
RankState = Literal["running", "done", "failed", "dead", "unresponsive"]
BROKEN_STATES = ("failed", "dead", "unresponsive")


@dataclass(frozen=True)
class RankStatus:
    """One rank's answer to a health poll, with the reports queued since the last one."""

    rank: int | None  # None before the actor's first `setup`
    state: RankState
    reports: list[RankReport] = field(default_factory=list)
    error: str | None = None  # the traceback of a failed rank, or why the driver lost it
    notice: Notice | None = None
    node_id: str | None = None  # filled in by the driver, which knows where each rank runs

    @property
    def broken(self) -> bool:
        return self.state in BROKEN_STATES
