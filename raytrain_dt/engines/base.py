"""The engine protocol: the train loop's only view of FSDP2 or DeepSpeed.

An engine owns the parallelized model and its optimizer. It runs one optimizer step over a
list of micro-batches and hands its state to and from checkpoints. The train loop does not
know which engine runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class StepResult:
    # Mean next-token loss over the global batch (already reduced over DP).
    loss: float
    grad_norm: float
    lr: float


class Engine(Protocol):
    def train_step(
        self, micro_batches: list[torch.Tensor], step: int, real: list[torch.Tensor] | None = None
    ) -> StepResult:
        """One optimizer step over `micro_batches`; `real` marks each one's real rows, which
        a padded layout needs (`engines.micro_loss`)."""

    def save(self, checkpoint_dir: str, digests=None) -> None:
        """Write model and optimizer shards (collective: every rank calls it). `digests` (a
        `checkpoint.digests.FileDigests`) records every file this rank wrote, with its size
        and SHA-256, for the commit's manifest."""

    def load(self, checkpoint_dir: str) -> None:
        """Read model and optimizer state into this layout (collective)."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded model parameters by name (collective; for tests and export)."""
