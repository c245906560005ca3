"""DeepSpeed ZeRO-1 under pipeline parallelism: our pipeline stages, DeepSpeed's optimizer.

The model is cut into stages by `parallel/pipeline_parallel.py` and driven by the same torch schedule
(GPipe, 1F1B or interleaved) as under FSDP2. DeepSpeed wraps this rank's stages (one
`StageUnion`, under the full model's parameter names) and shards their AdamW state over the DP
group of the stage: ZeRO-1, as DeepSpeed's own pipeline engine does it. ZeRO-2/3 are refused
with pipelines (`topology.planner.engine_refusal`): they would reduce or gather every stage's
gradients and parameters per micro-batch.

To DeepSpeed one optimizer step is a single micro-batch of everything this DP rank reads
(gradient accumulation 1): the schedule runs the real micro-batches and their backward outside
DeepSpeed, accumulating full gradients as ZeRO-1 does, and the boundary reduce-scatter, the
clipping and the sharded step are DeepSpeed's. The groups come from our device mesh through
DeepSpeed's `mpu` protocol: DP is the stage's data-parallel group, "model parallel" is the
pipeline group (the gradient norm sums over it; it also numbers the checkpoint files, one set
per stage).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from raytrain_dt.accel.device import DeviceSpec
from raytrain_dt.config.schema import TrainConfig
from raytrain_dt.engines.base import EngineBuild, StepResult
from raytrain_dt.engines.deepspeed_engine import DeepSpeedEngine, deepspeed_config
from raytrain_dt.engines.deepspeed_files import MODEL_STATES, StagedStep
from raytrain_dt.engines.optim import apply_lr_schedule
from raytrain_dt.models.materialize import materialize
from raytrain_dt.parallel.activation_checkpointing import apply_activation_checkpointing
from raytrain_dt.parallel.pipeline_parallel import (
    Pipeline,
    StageUnion,
    gather_stage_dicts,
    shared_pipeline_loss,
    split_model,
)
from raytrain_dt.topology.layout import Layout


class PipelineGroups:
    """DeepSpeed's `mpu`: the process groups of one rank of a pp x DP mesh (no TP)."""

    def __init__(self, mesh: DeviceMesh):
        self._dp = mesh["dp"].get_group()
        self._pp = mesh["pp"].get_group()

    def get_data_parallel_group(self):
        return self._dp

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self._dp)

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self._dp)

    def get_data_parallel_group_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self._dp)

    # "Model parallel" is the pipeline: stages hold disjoint parameters.
    def get_model_parallel_group(self):
        return self._pp

    def get_model_parallel_world_size(self) -> int:
        return dist.get_world_size(self._pp)

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank(self._pp)

    # No tensor parallelism: every stage counts all its parameters in the gradient norm.
    def get_tensor_model_parallel_rank(self) -> int:
        return 0

    def get_tensor_model_parallel_world_size(self) -> int:
        return 1


def pipeline_deepspeed_config(cfg: TrainConfig, layout: Layout, device: DeviceSpec) -> dict:
    """`deepspeed_config` with one DeepSpeed micro-batch per optimizer step (see module doc)."""
    config = deepspeed_config(cfg, layout, device)
    config["train_micro_batch_size_per_gpu"] = layout.micro_batch * layout.grad_accum
    config["gradient_accumulation_steps"] = 1
    return config


class DeepSpeedPipelineEngine(DeepSpeedEngine):
    """DeepSpeedEngine's checkpoints and state, with this rank's pipeline stages for its
    model and a pipeline schedule for the step."""

    def _initialize_deepspeed(self, build: EngineBuild) -> None:
        """Build this rank's pipeline stages and hand them to DeepSpeed as one `StageUnion`,
        with the mesh's DP and pp groups; then the schedule that drives the stages."""
        spec, cfg, layout, mesh = build.spec, build.cfg, build.layout, build.mesh
        device = build.device
        if layout.padded_slots:
            raise ValueError(f"{layout.describe()}: pipeline stages need an exact global batch")
        self.ds_config = pipeline_deepspeed_config(cfg, layout, device)
        pp_mesh = mesh["pp"]
        self._pp_group = pp_mesh.get_group()
        # The skeleton is cut first: a rank materializes only its stages (whole, as ZeRO-1
        # replicates parameters over the stage's DP group).
        parts = split_model(spec.skeleton(cfg.data.seq_len), layout, pp_mesh.get_local_rank(), spec)
        weights = build.initial_weights()
        for part in parts:
            materialize(part, device.torch_device, weights)
        if layout.activation_checkpointing:
            for part in parts:
                apply_activation_checkpointing(part, spec.blocks(part), keep_names=True)
        self._hand_to_deepspeed(StageUnion(parts, spec.parts), mpu=PipelineGroups(mesh))
        # The stages share their modules with the union DeepSpeed now manages (it moved and
        # flattened their parameters in place), so the schedule is built only now.
        self.pipeline = Pipeline(
            parts,
            layout,
            self._pp_group,
            pp_mesh.get_local_rank(),
            device.torch_device,
            self._loss,
        )

    def train_step(
        self, micro_batches: list[torch.Tensor], step: int, real: list[torch.Tensor] | None = None
    ) -> StepResult:
        """One schedule step and one DeepSpeed step; `real` is unused (no padded rows: the
        layout is refused at construction)."""
        t = self.cfg.trainer
        lr = apply_lr_schedule(self.optimizer, t, step)
        tokens = [self.device.to_device(m) for m in micro_batches]
        loss = shared_pipeline_loss(self.pipeline, tokens, self._pp_group, self.device)
        # Backward ran outside DeepSpeed, as in its own pipeline engine: reduce the accumulated
        # gradients into this rank's partition, then clip and step it.
        self.optimizer.reduce_gradients(pipeline_parallel=True)
        self.engine.step()
        grad_norm = float(self.engine.get_global_grad_norm())
        # Every micro-batch has the same number of tokens: the mean of the DP ranks' means.
        dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=self._dp_group)
        return StepResult(loss=float(loss) / self.layout.dims.dp, grad_norm=grad_norm, lr=lr)

    def _stages_moved(self, tag_dir: Path, staged: StagedStep) -> bool:
        """Whether this rank's stage file in `tag_dir` names other entries than its stages
        hold, on any rank (collective: all ranks then take the same, universal, path). Only
        the file's index is read (memory-mapped), not its tensors."""
        states = staged.fetch(tag_dir / MODEL_STATES.format(stage=dist.get_rank(self._pp_group)))
        saved = torch.load(states, map_location="cpu", mmap=True, weights_only=False)["module"]
        moved = self.device.scalar(float(set(saved) != set(self.engine.module.state_dict())))
        dist.all_reduce(moved, op=dist.ReduceOp.MAX)
        return bool(moved.item())

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 master parameters of every stage by name (collective over DP and pp)."""
        return gather_stage_dicts(super().full_state_dict(), self._pp_group)
