"""Pipeline parallelism: cut the decoder into stages and drive them with a torch schedule.

The model is split by hand (no tracing) into `pp * virtual_stages` stages, of the sizes
`topology/pipeline_stages.py` gives (balanced by cost, or `parallel.pp_layers`). A stage is the
decoder with the layers it does not own removed from `layers` and with `tok_embeddings` (all but
the first stage) or `norm` and `output` (all but the last) set to None, so it keeps the full
model's parameter names and checkpoints stay layout-free. Stage s lives on pp rank s % pp
(looped assignment, what the interleaved schedule expects). For another model the same holds
for the modules its `ModelSpec.parts` names (blocks, first-stage and last-stage modules).

Each optimizer step is one schedule step over `grad_accum` micro-batches of `micro_batch`
sequences. The schedule sums the micro-batch losses it back-propagates, so the loss function
divides by the micro-batch count: the gradient is that of the mean, as without pipelining.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from raytrain_dt.accel.device import DeviceSpec
from raytrain_dt.models.llama import next_token_loss
from raytrain_dt.models.model_spec import ModelParts, ModelSpec, get_path, llama_spec, set_path
from raytrain_dt.topology.layout import Layout
from raytrain_dt.topology.pipeline_stages import (
    pp_layers_refusal,
    split_of,
    stage_indices,
    too_few_microbatches,
)

log = logging.getLogger(__name__)


def validate_pipeline(layout: Layout, n_layers: int, tie_embeddings: bool) -> None:
    """ValueError naming the config key for a pipeline layout that cannot run."""
    pp, v, sched = layout.dims.pp, layout.virtual_stages, layout.pp_schedule
    if sched not in ("gpipe", "1f1b", "interleaved"):
        raise ValueError(f"parallel.pp_schedule: {sched!r} is not gpipe, 1f1b or interleaved")
    if v < 1:
        raise ValueError(f"parallel.virtual_stages: must be >= 1, got {v}")
    if v > 1 and sched != "interleaved":
        raise ValueError(
            f"parallel.virtual_stages: {v} needs parallel.pp_schedule=interleaved, got {sched}"
        )
    if sched == "interleaved" and v < 2:
        raise ValueError("parallel.virtual_stages: interleaved needs at least 2 stages per rank")
    if n_layers < pp * v:
        raise ValueError(
            f"parallel.pp: {pp} x parallel.virtual_stages {v} = {pp * v} stages exceed "
            f"model.n_layers={n_layers} (every stage needs at least one layer)"
        )
    refusal = pp_layers_refusal(layout.pp_layers, n_layers, pp, v) or too_few_microbatches(layout)
    if refusal:
        raise ValueError(refusal)
    if tie_embeddings:
        # The first and last stages would each need the one shared weight.
        raise ValueError("parallel.pp: tied embeddings with pipeline parallelism are not supported")
    if sched == "interleaved" and layout.grad_accum % pp:
        raise ValueError(
            f"trainer.grad_accum: {layout.grad_accum} micro-batches must be a multiple of "
            f"parallel.pp={pp} for the interleaved schedule"
        )


def split_model(
    model: nn.Module, layout: Layout, pp_rank: int, spec: ModelSpec | None = None
) -> list[nn.Module]:
    """This rank's stage models, in stage order. `model` must not be used afterwards.

    `spec` names the blocks and the end modules (our decoder's when None)."""
    spec = spec or llama_spec(model.shape)
    n_layers = spec.shape.n_layers
    validate_pipeline(layout, n_layers, spec.shape.tie_embeddings)
    num_stages = layout.dims.pp * layout.virtual_stages
    counts = split_of(spec.shape, layout.dims.pp, layout.virtual_stages, layout.pp_layers)
    starts = [sum(counts[:s]) for s in range(num_stages)]
    blocks = spec.blocks(model)
    names = list(blocks.keys())
    parts = []
    for stage in stage_indices(pp_rank, layout.dims.pp, layout.virtual_stages):
        owned = set(names[starts[stage] : starts[stage] + counts[stage]])
        dropped = [blocks[n] for n in names if n not in owned]
        if stage > 0:
            dropped += [get_path(model, p) for p in spec.parts.first]
        if stage < num_stages - 1:
            dropped += [get_path(model, p) for p in spec.parts.last]
        # Seeding deepcopy's memo with None for the dropped modules copies only what the stage
        # keeps; the full model is never duplicated.
        part = copy.deepcopy(model, memo={id(m): None for m in dropped})
        part_blocks = spec.blocks(part)
        for name in names:
            if name not in owned:
                del part_blocks[name]
        parts.append(part)
    log.info(
        "pipeline: %d stages with %s blocks; pp rank %d holds stages %s",
        num_stages,
        counts,
        pp_rank,
        stage_indices(pp_rank, layout.dims.pp, layout.virtual_stages),
    )
    return parts


class Pipeline:
    """This rank's stages and the schedule that runs one optimizer step's micro-batches."""

    def __init__(
        self,
        parts: list[nn.Module],
        layout: Layout,
        pp_group: dist.ProcessGroup,
        pp_rank: int,
        device: torch.device,
        loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = next_token_loss,
    ):
        pp, v = layout.dims.pp, layout.virtual_stages
        num_stages = pp * v
        self.n_microbatches = layout.grad_accum
        if self.n_microbatches < 4 * pp:
            log.warning(
                "pipeline: %d micro-batches for %d stages per step leaves a large bubble "
                "(idle fraction about %.0f%%); raise trainer.grad_accum to at least %d",
                self.n_microbatches,
                pp,
                100 * (pp - 1) / (self.n_microbatches + pp - 1),
                4 * pp,
            )
        indices = stage_indices(pp_rank, pp, v)
        self.stages = [
            PipelineStage(part, index, num_stages, device, group=pp_group)
            for part, index in zip(parts, indices, strict=True)
        ]
        self.is_first = indices[0] == 0
        self.is_last = indices[-1] == num_stages - 1
        loss_fn = self._loss_fn(loss)
        # scale_grads=False: the loss function already divides by the micro-batch count.
        if layout.pp_schedule == "interleaved":
            self.schedule = ScheduleInterleaved1F1B(
                self.stages, self.n_microbatches, loss_fn=loss_fn, scale_grads=False
            )
        else:
            single = ScheduleGPipe if layout.pp_schedule == "gpipe" else Schedule1F1B
            self.schedule = single(
                self.stages[0], self.n_microbatches, loss_fn=loss_fn, scale_grads=False
            )

    def _loss_fn(self, loss: Callable) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        n = self.n_microbatches

        def loss_fn(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
            return loss(logits, tokens) / n

        return loss_fn

    def step(
        self, micro_batches: list[torch.Tensor], targets: list[torch.Tensor] | None = None
    ) -> torch.Tensor | None:
        """Forward and backward over the micro-batches; the mean loss on the last stage.
        `targets` are what the loss scores (the micro-batches themselves when None; a cp
        rank's next-token labels under context parallelism)."""
        if len(micro_batches) != self.n_microbatches:
            raise ValueError(
                f"trainer.grad_accum: pipeline built for {self.n_microbatches} micro-batches, "
                f"got {len(micro_batches)}"
            )
        # The first stage needs the token ids and the last the targets; every pp peer of one
        # DP rank reads the same batch, so each takes what it needs from the same tensor.
        tokens = torch.cat(micro_batches)
        args = (tokens,) if self.is_first else ()
        losses: list[torch.Tensor] | None = [] if self.is_last else None
        self.schedule.step(
            *args,
            target=(tokens if targets is None else torch.cat(targets)) if self.is_last else None,
            losses=losses,
            return_outputs=False,
        )
        if losses is None:
            return None
        # Each entry is a micro-batch mean divided by the count: their sum is the mean (fp32, on
        # the stage's device: it enters the pp all-reduce).
        return torch.stack([loss.detach().float() for loss in losses]).sum()


def shared_pipeline_loss(
    pipeline: Pipeline,
    micro_batches: list[torch.Tensor],
    pp_group: dist.ProcessGroup,
    device: DeviceSpec,
    targets: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """One schedule step; its mean loss (fp32, on the device), known on every stage
    (collective over pp: only the last stage computes it)."""
    local = pipeline.step(micro_batches, targets)
    loss = device.scalar() if local is None else local
    dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=pp_group)
    return loss


class StageUnion(nn.Module):
    """The stages a rank holds, under the full model's parameter names.

    Not run (each stage runs inside its PipelineStage); it exists so the optimizer, state
    dicts and checkpoints see one module whose names are the unsplit model's, whatever the
    pipeline layout.
    """

    def __init__(self, parts: list[nn.Module], model_parts: ModelParts | None = None):
        super().__init__()
        paths = model_parts or ModelParts()
        blocks: dict[str, nn.Module] = {}
        for part in parts:
            blocks.update(get_path(part, paths.blocks).items())
        # The full model's order (first modules, layers by index, last modules), so state
        # dicts list names as the unsplit model does.
        for path in paths.first:
            for module in (get_path(part, path) for part in parts):
                if module is not None:
                    set_path(self, path, module)
        ordered = sorted(blocks.items(), key=lambda item: int(item[0]))
        set_path(self, paths.blocks, nn.ModuleDict(ordered))
        for path in paths.last:
            for module in (get_path(part, path) for part in parts):
                if module is not None:
                    set_path(self, path, module)


def gather_stage_dicts(local: dict, pp_group: dist.ProcessGroup) -> dict:
    """Every pp rank's entries merged (collective over the pp group)."""
    gathered: list[dict | None] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(gathered, local, group=pp_group)
    merged = {}
    for part in gathered:
        merged.update(part)
    return merged
