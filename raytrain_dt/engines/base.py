"""The engine protocol: the train loop's only view of FSDP2 or DeepSpeed, and `EngineBuild`,
what every engine is constructed from.

An engine owns the parallelized model and its optimizer. It runs one optimizer step over a
list of micro-batches and hands its state to and from checkpoints. The train loop and the
checkpointer do not know which engine runs: what differs between engines is declared here
(`supports_async_save`), never probed on the concrete class.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
from torch.distributed.device_mesh import DeviceMesh

from raytrain_dt.accel.device import DeviceSpec
from raytrain_dt.config.schema import TrainConfig
from raytrain_dt.models.materialize import WeightSource, initial_weights
from raytrain_dt.models.model_spec import ModelSpec
from raytrain_dt.topology.layout import Layout


@dataclass(frozen=True)
class EngineBuild:
    """Everything an engine is built from, one argument for every engine's constructor (and
    `engines.factory.build_engine`): the model's spec, the run's config, this rank's layout,
    mesh and device, and the weights to start from (the spec's own when None)."""

    spec: ModelSpec
    cfg: TrainConfig
    layout: Layout
    mesh: DeviceMesh
    device: DeviceSpec
    weights: WeightSource | None = None

    def initial_weights(self) -> WeightSource:
        """`weights`, or the spec's initial weights (its random init from the run's seed, or
        the pretrained weights it names)."""
        return self.weights or initial_weights(self.spec, self.cfg.run.seed)


@dataclass(frozen=True)
class RouterStats:
    """A mixture-of-experts step's routing over the global batch, summed over MoE layers."""

    # Token copies (assignments: k per token and MoE layer) each expert accepted and ran.
    tokens_per_expert: list[int]
    # Assignments an expert refused for capacity (their expert output is zero).
    dropped: int

    @property
    def drop_rate(self) -> float:
        """Dropped share of all routed assignments (accepted + dropped)."""
        routed = sum(self.tokens_per_expert) + self.dropped
        return self.dropped / routed if routed else 0.0

    def as_record(self) -> dict:
        """metrics.jsonl's `router` field."""
        return {
            "tokens_per_expert": self.tokens_per_expert,
            "dropped": self.dropped,
            "drop_rate": self.drop_rate,
        }


@dataclass(frozen=True)
class StepResult:
    # Mean next-token loss over the global batch (already reduced over DP).
    loss: float
    grad_norm: float
    lr: float
    # Mixture-of-experts models only.
    router: RouterStats | None = None


class Engine(Protocol):
    # Whether `save_async`, a `wrap_writer` for `save`, in-memory copies (`stage_copy`, and a
    # `storage_reader` for `load`) are supported (FSDP2's DCP: yes; DeepSpeed writes its own
    # files: no, `kill_rank_mid_save` is refused for it and it resumes from durable checkpoints).
    supports_async_save: ClassVar[bool]

    def warm_up(self) -> None:
        """Pay the first step's one-time costs before training starts (collective; changes no
        state). A no-op where an engine has none."""

    def train_step(
        self, micro_batches: list[torch.Tensor], step: int, real: list[torch.Tensor] | None = None
    ) -> StepResult:
        """One optimizer step over `micro_batches`; `real` marks each one's real rows, which
        a padded layout needs (`engines.micro_loss`)."""

    def save(self, checkpoint_dir: str, digests=None, wrap_writer=None) -> None:
        """Write model and optimizer shards (collective: every rank calls it). `digests` (a
        `checkpoint.digests.FileDigests`) records every file this rank wrote, with its size
        and checksum, for the commit's manifest. `wrap_writer` wraps the DCP writer (only
        where `supports_async_save`; chaos uses it to fail a save midway)."""

    def save_async(
        self, checkpoint_dir: str, process_group, digests=None, wrap_writer=None
    ) -> Future:
        """Stage the state and write it in the background on `process_group` (only where
        `supports_async_save`); the future completes when this rank's files are written."""

    def stage_copy(self, stager) -> Future:
        """Copy this rank's model and optimizer shards into `stager`'s host buffers (an
        in-memory copy; only where `supports_async_save`); the next optimizer step waits for
        the copy. The future resolves to the staged state dict."""

    def load(self, checkpoint_dir: str, storage_reader=None) -> None:
        """Read model and optimizer state into this layout (collective); `storage_reader`
        replaces the DCP reader of `checkpoint_dir` (an in-memory copy's; only where
        `supports_async_save`)."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded model parameters by name (collective; for tests and export)."""
