"""FSDP2 engine: `fully_shard` per block and at the root, AdamW, clipping, DCP state.

The model is never whole on a rank: its skeleton (meta parameters) is cut into this rank's
pipeline stages, tensor-parallelized and sharded, and only then are this rank's shards
allocated and filled (`models.materialize`), with the same values whatever the layout.

zero_stage maps to FSDP2 as: 0 -> replicate only (DDP semantics through HSDP with shard size
1), 1 and 2 -> grad-op sharding (`reshard_after_forward=False`), 3 -> full sharding. Each
micro-step's loss is divided by the accumulation count, so the reduced gradient is the gradient
of the global-batch mean. As in ZeRO, stages 0 and 1 keep full gradients while accumulating:
their sync is switched off on non-final micro-steps (one reduction per step); stages 2 and 3
shard gradients, so they reduce-scatter every micro-step rather than hold every unsharded
gradient until the last one (the memory and cost models in `topology/` price exactly this).

With pipeline parallelism (`parallel/pipeline_parallel.py`) each rank parallelizes its stage models the
same way (TP, AC, FSDP over its DP mesh) and one schedule step replaces the micro-step loop; the
gradient norm then sums over the pp group, and state dicts keep the unsplit model's names.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from concurrent.futures import Future

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from raytrain_dt.checkpoint.export import model_tensors
from raytrain_dt.checkpoint.memory_files import CopyReader, load_packed
from raytrain_dt.checkpoint.record import check_fits, tensor_shapes
from raytrain_dt.checkpoint.staging import ReusableStager
from raytrain_dt.checkpoint.storage import (
    dcp_reader,
    dcp_writer,
    forget_save_plans,
    new_plan_key,
    save_planner,
)
from raytrain_dt.checkpoint.write_process import OffloadedWriter
from raytrain_dt.engines.base import EngineBuild, StepResult
from raytrain_dt.engines.grad_norm import clip_gradients
from raytrain_dt.engines.live_state import LiveStateDicts, holds_the_parameters
from raytrain_dt.engines.micro_loss import micro_step_loss
from raytrain_dt.engines.moe_step import aux_row_weights, check_moe_layout, reduce_router_stats
from raytrain_dt.engines.optim import apply_lr_schedule, build_adamw
from raytrain_dt.models.materialize import materialize
from raytrain_dt.models.moe import set_aux_row_weights
from raytrain_dt.parallel.activation_checkpointing import apply_activation_checkpointing
from raytrain_dt.parallel.context_parallel import ContextShardLoss, shard_batch
from raytrain_dt.parallel.device_mesh import expert_fsdp_mesh
from raytrain_dt.parallel.expert_parallel import apply_expert_parallel, expert_modules
from raytrain_dt.parallel.pipeline_parallel import (
    Pipeline,
    StageUnion,
    gather_stage_dicts,
    shared_pipeline_loss,
    split_model,
)
from raytrain_dt.parallel.tensor_parallel import loss_context

# Optimizer state keyed per parameter name ("state.<name>.exp_avg", "param_groups.<name>.lr"):
# pipeline stages hold different parameters, and a nested param_groups list would be one
# checkpoint entry that only one rank's version survives in. Per-name keys also let a checkpoint
# load into any other layout.
STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class FSDP2Engine:
    supports_async_save = True

    def __init__(self, build: EngineBuild):
        """Builds the spec's model as a skeleton (no parameter memory), cuts this rank's
        pipeline stages, parallelizes them, then materializes only this rank's shards from the
        build's weights (`EngineBuild.initial_weights`): no rank ever holds the full model."""
        self.cfg = cfg = build.cfg
        self.layout = layout = build.layout
        self.mesh = mesh = build.mesh
        self.device = device = build.device
        # Which modules are blocks, ends, TP plan and loss.
        self.spec = spec = build.spec
        self._loss = self.spec.loss_fn()
        # Context parallelism: this rank feeds its chunks of each sequence and scores their
        # next tokens; the loss is then reduced over the cp ranks too.
        self._cp_rank = mesh["cp"].get_local_rank() if layout.dims.cp_enabled else 0
        if layout.dims.cp_enabled:
            self._loss = ContextShardLoss(cfg.data.seq_len, layout.dims.cp)
        self.pipeline: Pipeline | None = None
        self._pp_group = None
        weights = build.initial_weights()
        model = spec.skeleton(cfg.data.seq_len)
        check_moe_layout(model, spec.name, layout)
        if layout.dims.pp_enabled:
            if layout.padded_slots:
                raise ValueError(f"{layout.describe()}: pipeline stages need an exact global batch")
            pp_mesh = mesh["pp"]
            self._pp_group = pp_mesh.get_group()
            parts = split_model(model, layout, pp_mesh.get_local_rank(), self.spec)
        else:
            parts = [model]
        # Offloaded shards live (and step) in host memory; buffers are used by the compute.
        param_device = "cpu" if layout.offload_optimizer else device.torch_device
        for part in parts:
            self._parallelize(part)
            materialize(part, param_device, weights, buffer_device=device.torch_device)
        if layout.dims.pp_enabled:
            self.pipeline = Pipeline(
                parts,
                layout,
                self._pp_group,
                pp_mesh.get_local_rank(),
                device.torch_device,
                self._loss,
            )
            # One module under the full model's names for the optimizer and checkpoints.
            model = StageUnion(parts, self.spec.parts)
        self.model = model
        self.optimizer = build_adamw(model, self.cfg.trainer, sharded=True)
        self._loss_group = mesh["dp_cp" if layout.dims.cp_enabled else "dp"].get_group()
        self._moe = spec.shape.is_moe
        # Router statistics sum over every rank holding distinct tokens of the batch.
        self._tokens_group = mesh["dp_cp"].get_group() if self._moe else None

    def _parallelize(self, model: nn.Module) -> None:
        """TP, then activation checkpointing, then FSDP over the DP mesh (one pipeline stage,
        still on the meta device)."""
        layout, mesh, device = self.layout, self.mesh, self.device
        # Before TP: sequence parallelism then splits this rank's positions, not the sequence.
        if layout.dims.cp_enabled:
            self.spec.apply_context_parallel(model, mesh["cp"], self.cfg.data.seq_len)
        if layout.dims.tp_enabled:
            self.spec.apply_tensor_parallel(model, mesh["tp"], layout.sequence_parallel)
        if layout.dims.ep_enabled:
            apply_expert_parallel(model, mesh["ep"])
        if layout.activation_checkpointing:
            apply_activation_checkpointing(model, self.spec.blocks(model))
        dp_mesh = mesh["dp_replicate", "dp_shard_cp"]
        shard_kwargs: dict = {"mesh": dp_mesh}
        if device.mixed_precision:
            shard_kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=device.param_dtype, reduce_dtype=device.reduce_dtype
            )
        if layout.offload_optimizer:
            shard_kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.pin_memory)
        reshard = layout.zero_stage == 3
        for block in self.spec.blocks(model).values():
            if layout.dims.ep_enabled:
                self._shard_experts(block, reshard, shard_kwargs)
            fully_shard(block, reshard_after_forward=reshard, **shard_kwargs)
        # The root holds embeddings, final norm and head; they are used last in backward, so
        # resharding them after forward would only add an all-gather.
        fully_shard(model, reshard_after_forward=False, **shard_kwargs)

    def _shard_experts(self, block: nn.Module, reshard: bool, shard_kwargs: dict) -> None:
        """Under ep > 1: each expert group's FSDP unit, over the ranks holding the same experts
        (`expert_fsdp_mesh`; under cp also the cp ranks, whose expert gradients are summed by
        an all-reduce after FSDP's reduction). Its gradient sums every ep peer's tokens, so it
        is divided by the whole DP mesh's size (as every other gradient is), not by the
        expert mesh's."""
        dp_size = shard_kwargs["mesh"].size()
        mesh = expert_fsdp_mesh(self.mesh)
        # That divide factor reduce-scatters with PREMUL_SUM, which only NCCL has; elsewhere a
        # sum, then a division. Not with one shard: torch 2.13 then divides twice (its copy
        # path for a single rank divides and so does the post-division); nor is it needed
        # there, as no reduce-scatter runs.
        force_sum = not self.device.premul_sum and mesh["dp_shard_mod_ep"].size() > 1
        for experts in expert_modules(block):
            fully_shard(experts, reshard_after_forward=reshard, **{**shard_kwargs, "mesh": mesh})
            experts.set_gradient_divide_factor(float(dp_size))
            experts.set_force_sum_reduction_for_comms(force_sum)
            if self.layout.dims.cp_enabled:
                experts.set_all_reduce_hook(self._sum_over_cp)

    def _sum_over_cp(self, reduced_grad: torch.Tensor) -> None:
        dist.all_reduce(reduced_grad, op=dist.ReduceOp.SUM, group=self.mesh["cp"].get_group())

    def train_step(
        self, micro_batches: list[torch.Tensor], step: int, real: list[torch.Tensor] | None = None
    ) -> StepResult:
        """One optimizer step; `real` marks each micro-batch's real rows (needed when the
        layout pads, see `engines.micro_loss`)."""
        t = self.cfg.trainer
        lr = apply_lr_schedule(self.optimizer, t, step)
        if self.pipeline is not None:
            global_loss = self._pipeline_micro_steps(micro_batches)
        else:
            global_loss = self._micro_steps(micro_batches, real or [None] * len(micro_batches))
        grad_norm = clip_gradients(
            self.model.parameters(), t.grad_clip, self.device, self._pp_group
        )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        # Every micro-batch has the same number of tokens (padding weighted as in
        # `micro_step_loss`), so the global-batch mean is the mean of the per-rank means over DP
        # (and over cp, whose ranks' losses are scaled by cp: `ContextShardLoss`).
        dist.all_reduce(global_loss, op=dist.ReduceOp.SUM, group=self._loss_group)
        dims = self.layout.dims
        router = None
        if self._moe:
            router = reduce_router_stats(
                self.model,
                self.spec.shape.n_experts,
                self.layout.grad_accum,
                self.device.torch_device,
                self._tokens_group,
                self._pp_group,
            )
        return StepResult(
            loss=float(global_loss) / (dims.dp * dims.cp), grad_norm=grad_norm, lr=lr, router=router
        )

    def _inputs_and_targets(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What the model reads and what its loss scores: the tokens themselves, or under
        context parallelism this rank's chunks and their next-token labels."""
        if not self.layout.dims.cp_enabled:
            return tokens, tokens
        return shard_batch(tokens, self.layout.dims.cp, self._cp_rank)

    def _micro_steps(self, micro_batches: list[torch.Tensor], real: list) -> torch.Tensor:
        """Forward/backward per micro-batch; this rank's mean loss (fp32, on the device: it
        enters the DP all-reduce)."""
        accum = len(micro_batches)
        loss_sum = self.device.scalar()
        for i, (tokens, rows) in enumerate(zip(micro_batches, real, strict=True)):
            last = i == accum - 1
            self.model.set_requires_gradient_sync(last or not self.layout.grad_sync_deferred)
            inputs, targets = self._inputs_and_targets(self.device.to_device(tokens))
            if self._moe:
                set_aux_row_weights(
                    self.model, aux_row_weights(self.layout, rows, len(tokens), self.device)
                )
            with loss_context(self.layout.dims.tp_enabled):
                loss = micro_step_loss(self._loss, self.model(inputs), targets, rows, self.layout)
                (loss / accum).backward()
            loss_sum += loss.detach().float()
        return loss_sum / accum

    def _pipeline_micro_steps(self, micro_batches: list[torch.Tensor]) -> torch.Tensor:
        """One schedule step; the mean loss, known on every stage of this pipeline."""
        if self._moe:  # the schedule cuts micro-batches of layout.micro_batch rows, never padded
            weights = aux_row_weights(self.layout, None, self.layout.micro_batch, self.device)
            set_aux_row_weights(self.model, weights)
        with loss_context(self.layout.dims.tp_enabled):
            pairs = [self._inputs_and_targets(self.device.to_device(m)) for m in micro_batches]
            return shared_pipeline_loss(
                self.pipeline,
                [inputs for inputs, _ in pairs],
                self._pp_group,
                self.device,
                targets=[targets for _, targets in pairs],
            )

    # --- checkpoint state ----------------------------------------------------------------------
    _stager: ReusableStager | None = None  # created by the first async save, then reused
    staging_wait_s = 0.0  # how long the last optimizer step waited for staged copies
    # Copies (async saves, in-memory copies) the next optimizer step waits for, and the one
    # pre-hook that waits: registered once, never removed inside `step`'s loop over its hooks
    # (a second hook removing itself there raised "OrderedDict mutated during iteration" when
    # a save and an in-memory copy were staged from the same step).
    _staging: list[Future] | None = None
    _staging_hook = None
    _live_state: LiveStateDicts | None = None  # the copies' state dicts, built once
    _plan_key: str | None = None  # DCP's cached save plans (`checkpoint.storage.save_planner`)

    def save(self, checkpoint_dir: str, digests=None, wrap_writer=None) -> None:
        """`digests`: records each file this rank writes, hashed as written. `wrap_writer`
        wraps the DCP writer (fault injection)."""
        model_sd, optim_sd = self._state_dicts()
        writer = dcp_writer(checkpoint_dir, digests)
        dcp.save(
            {"model": model_sd, "optim": optim_sd},
            storage_writer=wrap_writer(writer) if wrap_writer else writer,
            planner=self._save_planner(),
        )

    def save_async(
        self, checkpoint_dir: str, process_group, digests=None, wrap_writer=None
    ) -> Future:
        """Save in the background; returns the future of the write.

        Training is blocked only while the state dict is gathered: the shards are copied into
        CPU buffers reused across saves (`ReusableStager`; the caller keeps one save in flight)
        on a staging thread during the next step's forward and backward, and that step's
        optimizer, the first thing to change the saved state, waits for the copy. The write's
        collectives run on `process_group` (gloo), never on the training group, so they cannot
        interleave with the next step's collectives. With `checkpoint.async_writer=process`
        the buffers are shared with the rank's writer process, which writes the bytes
        (`checkpoint/write_process.py`); DCP's thread keeps the plans and the metadata.
        """
        offload = self.cfg.checkpoint.async_writer == "process"
        if self._stager is None:
            self._stager = ReusableStager(background=True, shared=offload)
        stager = self._stager
        writer = (
            OffloadedWriter(checkpoint_dir, digests, lambda: stager.shared_buffer)
            if offload
            else dcp_writer(checkpoint_dir, digests)
        )
        model_sd, optim_sd = self._state_dicts()
        response = dcp.async_save(
            {"model": model_sd, "optim": optim_sd},
            storage_writer=wrap_writer(writer) if wrap_writer else writer,
            process_group=process_group,
            async_stager=self._stager,
            planner=self._save_planner(),
        )
        self._hold_optimizer_until(response.staging_completion)
        return response.upload_completion

    def _save_planner(self):
        if self._plan_key is None:  # this engine's own: its process group's (`save_planner`)
            self._plan_key = new_plan_key(self.layout.describe())
            weakref.finalize(self, forget_save_plans, self._plan_key)
        return save_planner(self._plan_key)

    def _hold_optimizer_until(self, staged: Future) -> None:
        if self._staging_hook is None:
            self._staging = []
            self._staging_hook = self.optimizer.register_step_pre_hook(self._wait_for_staging)
        self._staging.append(staged)

    def _wait_for_staging(self, *_) -> None:
        pending, self._staging = self._staging, []
        started = time.perf_counter()
        for staged in pending:
            # A failed copy fails the save (its write future), not the training step.
            with contextlib.suppress(Exception):
                staged.result()
        self.staging_wait_s = time.perf_counter() - started

    def stage_copy(self, stager: ReusableStager) -> Future:
        """Copy model and optimizer shards into `stager`'s host buffers on its thread (an
        in-memory copy, `worker/peer_copies.py`); the next optimizer step waits for the copy,
        as for an async save. Returns the future of the staged state dict."""
        if self._live_state is None:
            self._live_state = LiveStateDicts(self.model, self.optimizer, self._state_dicts)
        model_sd, optim_sd = self._live_state()
        staged = stager.stage({"model": model_sd, "optim": optim_sd})
        self._hold_optimizer_until(staged)
        return staged

    def load(self, checkpoint_dir: str, storage_reader=None) -> None:
        model_sd, optim_sd = self._state_dicts()
        reader = storage_reader or dcp_reader(checkpoint_dir)
        # Every wrong shape in one error, before anything is read (DCP's metadata alone). A
        # pipeline stage checks only the tensors it holds.
        ours = tensor_shapes(model_sd)
        saved = {n: list(size) for n, (size, _) in model_tensors(checkpoint_dir, reader).items()}
        check_fits(checkpoint_dir, {n: saved[n] for n in ours if n in saved}, ours)
        state = {"model": model_sd, "optim": optim_sd}
        if isinstance(reader, CopyReader):  # in-memory copies are written packed
            state = load_packed(state, reader)
        else:
            dcp.load(state, storage_reader=reader)
        if holds_the_parameters(self.model, state["model"]):
            # Read into the parameters themselves (the sharded state dict's DTensors share
            # their storage): loading them again would copy each onto itself, through
            # DTensor's sharding propagation, which a new layout has not cached (a third of a
            # re-formation's load from in-memory copies on this host).
            set_optimizer_state_dict(
                self.model, self.optimizer, state["optim"], options=STATE_DICT_OPTIONS
            )
        else:
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
                options=STATE_DICT_OPTIONS,
            )

    def _state_dicts(self) -> tuple[dict, dict]:
        self.optimizer.init_state()  # not DCP's zero-gradient step on DTensors (engines/optim.py)
        return get_state_dict(self.model, self.optimizer, options=STATE_DICT_OPTIONS)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        local = {
            name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu()
            for name, value in self.model.state_dict().items()
        }
        if self._pp_group is None:
            return local
        return gather_stage_dicts(local, self._pp_group)

    def warm_up(self) -> None:
        """Clip zero gradients once (collective; changes no state), so DTensor has computed
        the shardings of the step's foreach ops before the first step (seconds on CPU). The
        optimizer's own ops are computed by a checkpoint load, which initializes its state."""
        for param in self.model.parameters():
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
        clip_gradients(
            self.model.parameters(), self.cfg.trainer.grad_clip, self.device, self._pp_group
        )
        self.optimizer.zero_grad(set_to_none=True)
