"""FSDP2 engine: `fully_shard` per block and at the root, AdamW, clipping, DCP state.

zero_stage maps to FSDP2 as: 0 -> replicate only (DDP semantics through HSDP with shard size
1), 1 and 2 -> grad-op sharding (`reshard_after_forward=False`), 3 -> full sharding. Gradient
sync is switched off on non-final micro-steps, and each micro-step's loss is divided by the
accumulation count, so the reduced gradient is the gradient of the global-batch mean.

With pipeline parallelism (`parallel/pipeline.py`) each rank parallelizes its stage models the
same way (TP, AC, FSDP over its DP mesh) and one schedule step replaces the micro-step loop; the
gradient norm then sums over the pp group, and state dicts keep the unsplit model's names.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from raytrain_dt.checkpoint.storage import dcp_reader, dcp_writer
from raytrain_dt.config.schema import TrainConfig
from raytrain_dt.engines.base import StepResult
from raytrain_dt.engines.optim import build_adamw, set_lr
from raytrain_dt.engines.schedule import lr_at
from raytrain_dt.models.llama import next_token_loss
from raytrain_dt.parallel.pipeline import Pipeline, StageUnion, gather_stage_dicts, split_model
from raytrain_dt.parallel.tensor_parallel import apply_tensor_parallel
from raytrain_dt.topology.layout import Layout
from raytrain_dt.worker.device import DeviceSpec

# Optimizer state keyed per parameter name ("state.<name>.exp_avg", "param_groups.<name>.lr"):
# pipeline stages hold different parameters, and a nested param_groups list would be one
# checkpoint entry that only one rank's version survives in. Per-name keys also let a checkpoint
# load into any other layout.
STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def apply_activation_checkpointing(model: nn.Module) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for name, block in list(model.layers.named_children()):
        model.layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False))


class FSDP2Engine:
    def __init__(
        self,
        model: nn.Module,
        cfg: TrainConfig,
        layout: Layout,
        mesh: DeviceMesh,
        device: DeviceSpec,
    ):
        self.cfg = cfg
        self.layout = layout
        self.mesh = mesh
        self.device = device
        self.pipeline: Pipeline | None = None
        self._pp_group = None
        if layout.dims.pp_enabled:
            pp_mesh = mesh["pp"]
            self._pp_group = pp_mesh.get_group()
            parts = split_model(model, layout, pp_mesh.get_local_rank())
        else:
            parts = [model]
        for part in parts:
            self._parallelize(part)
        if layout.dims.pp_enabled:
            cuda = device.device_type == "cuda"
            stage_device = device.device(torch.cuda.current_device() if cuda else 0)
            self.pipeline = Pipeline(
                parts, layout, self._pp_group, pp_mesh.get_local_rank(), stage_device
            )
            # One module under the full model's names for the optimizer and checkpoints.
            model = StageUnion(parts)
        self.model = model
        self.optimizer = build_adamw(model, self.cfg.trainer)
        self._dp_group = mesh["dp"].get_group()

    def _parallelize(self, model: nn.Module) -> None:
        """TP, then activation checkpointing, then FSDP over the DP mesh (one pipeline stage)."""
        layout, mesh, device = self.layout, self.mesh, self.device
        if layout.dims.tp_enabled:
            apply_tensor_parallel(model, mesh["tp"], layout.sequence_parallel)
        if layout.activation_checkpointing:
            apply_activation_checkpointing(model)
        dp_mesh = mesh["dp_replicate", "dp_shard_cp"]
        shard_kwargs: dict = {"mesh": dp_mesh}
        if device.mixed_precision:
            shard_kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=device.param_dtype, reduce_dtype=device.reduce_dtype
            )
        if layout.offload_optimizer:
            shard_kwargs["offload_policy"] = CPUOffloadPolicy()
        reshard = layout.zero_stage == 3
        for block in model.layers.values():
            fully_shard(block, reshard_after_forward=reshard, **shard_kwargs)
        # The root holds embeddings, final norm and head; they are used last in backward, so
        # resharding them after forward would only add an all-gather.
        fully_shard(model, reshard_after_forward=False, **shard_kwargs)
        if device.device_type == "cuda" and not layout.offload_optimizer:
            model.to(device.device(torch.cuda.current_device()))

    def _to_device(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.device.device_type == "cuda":
            return tokens.to(self.device.device(torch.cuda.current_device()), non_blocking=True)
        return tokens

    def train_step(self, micro_batches: list[torch.Tensor], step: int) -> StepResult:
        t = self.cfg.trainer
        lr = lr_at(
            step,
            lr=t.lr,
            warmup_steps=t.warmup_steps,
            total_steps=t.steps,
            min_lr_ratio=t.min_lr_ratio,
        )
        set_lr(self.optimizer, lr)
        if self.pipeline is not None:
            global_loss = self._pipeline_micro_steps(micro_batches)
        else:
            global_loss = self._micro_steps(micro_batches)
        grad_norm = clip_gradients(self.model.parameters(), t.grad_clip, self._pp_group)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        # Every micro-batch has the same number of tokens, so the global-batch mean is the
        # mean of the per-rank means over DP.
        dist.all_reduce(global_loss, op=dist.ReduceOp.SUM, group=self._dp_group)
        return StepResult(loss=float(global_loss) / self.layout.dims.dp, grad_norm=grad_norm, lr=lr)

    def _micro_steps(self, micro_batches: list[torch.Tensor]) -> torch.Tensor:
        """Forward/backward per micro-batch; this rank's mean loss."""
        accum = len(micro_batches)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for i, tokens in enumerate(micro_batches):
            self.model.set_requires_gradient_sync(i == accum - 1)
            tokens = self._to_device(tokens)
            loss = next_token_loss(self.model(tokens), tokens)
            (loss / accum).backward()
            loss_sum += loss.detach().double().cpu()
        return loss_sum / accum

    def _pipeline_micro_steps(self, micro_batches: list[torch.Tensor]) -> torch.Tensor:
        """One schedule step; the mean loss, known on every stage of this pipeline."""
        local = self.pipeline.step([self._to_device(m) for m in micro_batches])
        # Only the last stage computes the loss; rank 0 (first stage) reports it.
        loss = torch.zeros((), dtype=torch.float64) if local is None else local
        dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=self._pp_group)
        return loss

    # --- checkpoint state ----------------------------------------------------------------------
    def save(self, checkpoint_dir: str) -> None:
        model_sd, optim_sd = self._state_dicts()
        dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=dcp_writer(checkpoint_dir))

    def save_async(self, checkpoint_dir: str, process_group) -> Future:
        """Stage the shards to CPU memory and write them in a background thread.

        Returns once staging is done, so training stalls only for the copy. The background
        collectives run on `process_group` (gloo), never on the training group, so they cannot
        interleave with the next step's collectives.
        """
        model_sd, optim_sd = self._state_dicts()
        return dcp.async_save(
            {"model": model_sd, "optim": optim_sd},
            storage_writer=dcp_writer(checkpoint_dir),
            process_group=process_group,
        )

    def load(self, checkpoint_dir: str) -> None:
        model_sd, optim_sd = self._state_dicts()
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, storage_reader=dcp_reader(checkpoint_dir))
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=STATE_DICT_OPTIONS,
        )

    def _state_dicts(self) -> tuple[dict, dict]:
        return get_state_dict(self.model, self.optimizer, options=STATE_DICT_OPTIONS)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        local = {
            name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu()
            for name, value in self.model.state_dict().items()
        }
        if self._pp_group is None:
            return local
        return gather_stage_dicts(local, self._pp_group)


def clip_gradients(parameters, max_norm: float, pp_group=None) -> float:
    """Total gradient norm over all shards and pipeline stages; clips in place if max_norm > 0."""
    with_grads = [p for p in parameters if p.grad is not None]
    # Norms are taken per mesh (DTensor ops cannot mix meshes) and combined as plain tensors.
    by_mesh: dict = {}
    for p in with_grads:
        by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p.grad)
    partial_norms = []
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        partial_norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = (
        torch.linalg.vector_norm(torch.stack(partial_norms))
        if partial_norms
        else torch.zeros((), dtype=torch.float32)
    )
    if pp_group is not None:
        # Stages hold disjoint parameters: squared norms add up across the pipeline.
        total = total.double() ** 2
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_group)
        total = total.sqrt().float()
    if max_norm > 0:
        # Takes parameters (it scales p.grad), with the norm over every shard.
        torch.nn.utils.clip_grads_with_norm_(with_grads, max_norm, total, foreach=True)
    return float(total)
