"""DeepSpeed engine: ZeRO stage 0-3 data parallelism behind the Engine protocol (ZeRO-1 with
pipeline stages: `deepspeed_pipeline`, which reuses this engine's state and checkpoints).

The model is built from its spec by the engine. ZeRO-3 partitions it as it is constructed
(`deepspeed.zero.Init`), and each rank fills only its own partition of every parameter with the
values every layout starts from (`build_partitioned`), so no rank holds the full model. ZeRO-0/1/2
replicate the parameters on every DP rank by definition: there each rank materializes the whole
model on its device (and the planner's memory model prices exactly that).

The model is wrapped by `deepspeed.initialize` with our own AdamW (`engines.optim`, same param
groups as FSDP2 and the reference) as a client optimizer, and a config generated from ours by
`deepspeed_config`, the one place where DeepSpeed's defaults meet our semantics. DeepSpeed owns
gradient accumulation (loss scaled by 1/GAS, gradients reduced only at the boundary), clipping
and the optimizer step; we set the learning rate every step from `lr_at`.

Checkpoints are DeepSpeed's own format under `<step dir>/ds`. A checkpoint written at another
DP size or pipeline split is converted once to a universal checkpoint (`<step dir>/ds_universal`,
see `deepspeed_files`) and loaded from there. A step directory on object storage is staged on
each rank's local disk (`deepspeed_files.StagedStep`): saves upload what the rank wrote, loads
fetch what the rank reads, and a conversion is made by rank 0 from a local copy and uploaded
next to the original for every rank to fetch.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from raytrain_dt.accel.device import DeviceSpec
from raytrain_dt.checkpoint.digests import FileDigests
from raytrain_dt.config.schema import TrainConfig
from raytrain_dt.engines.base import EngineBuild, StepResult
from raytrain_dt.engines.deepspeed_files import (
    MODEL_STATES,
    StagedStep,
    fetching_loads,
    recording_saves,
    saved_layout,
    to_universal,
)
from raytrain_dt.engines.micro_loss import micro_step_loss
from raytrain_dt.engines.optim import apply_lr_schedule, build_adamw
from raytrain_dt.errors import ConfigError
from raytrain_dt.models.materialize import WeightSource, read_flat, unique_parameters
from raytrain_dt.models.model_spec import ModelSpec
from raytrain_dt.parallel.activation_checkpointing import apply_activation_checkpointing
from raytrain_dt.topology.layout import Layout
from raytrain_dt.topology.memory import DEEPSPEED_REDUCE_BUCKET
from raytrain_dt.topology.pins import engine_refusal

log = logging.getLogger("raytrain_dt.deepspeed")

TAG = "ds"
UNIVERSAL_TAG = "ds_universal"


def check_layout(layout: Layout, precision: str = "fp32") -> None:
    """Reject what this engine cannot run, naming the config key at fault (the same refusal
    the planner gives at plan time)."""
    d = layout.dims
    refusal = engine_refusal("deepspeed", d.tp, d.pp, layout.zero_stage, precision)
    if refusal:
        raise ConfigError(refusal)
    if d.cp > 1:
        raise ConfigError(f"parallel.cp: {d.cp} is not supported by engine.name=deepspeed")


def deepspeed_config(cfg: TrainConfig, layout: Layout, device: DeviceSpec) -> dict:
    """The DeepSpeed config for this layout. Pure: no torch.distributed, no DeepSpeed import."""
    bf16 = device.mixed_precision and device.param_dtype == torch.bfloat16
    check_layout(layout, "bf16" if bf16 else "fp32")
    zero: dict = {
        "stage": layout.zero_stage,
        # We report the norm every step (it is also what clipping uses).
        "compute_grad_norm": True,
        # ZeRO-1/2 allocate a whole bucket of this many elements during backward; pinned here
        # so the planner's memory model prices the same buffer.
        "reduce_bucket_size": DEEPSPEED_REDUCE_BUCKET,
    }
    if layout.zero_stage == 3:
        # DeepSpeed keeps parameters under 1e5 elements unpartitioned by default; the planner's
        # memory model (and FSDP2's ZeRO-3) shards every parameter, so do the same.
        zero["stage3_param_persistence_threshold"] = 0
        # Saving writes each rank's fp32 partition; no 16-bit consolidated copy is wanted.
        zero["stage3_gather_16bit_weights_on_model_save"] = False
    if layout.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": device.pin_memory}
    config: dict = {
        # Rows per step, padding included (DeepSpeed checks micro x GAS x DP against it).
        "train_batch_size": layout.batch_slots,
        "train_micro_batch_size_per_gpu": layout.micro_batch,
        "gradient_accumulation_steps": layout.grad_accum,
        # DeepSpeed's default is 1.0; 0 must mean "no clipping" as in our config.
        "gradient_clipping": float(cfg.trainer.grad_clip),
        "zero_optimization": zero,
        # Gradients are averaged over DP after the reduce, as in FSDP2 and the reference
        # (DeepSpeed defaults, pinned: a pre-division would change rounding).
        "prescale_gradients": False,
        "gradient_predivide_factor": 1.0,
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": False},
        # The client optimizer is torch AdamW; DeepSpeed would otherwise insist on its own
        # DeepSpeedCPUAdam (a JIT-built C++ op) when the optimizer is offloaded.
        "zero_force_ds_cpu_optimizer": False,
        "zero_allow_untested_optimizer": False,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        "dump_state": False,
        # Same-size checkpoints load as written; `load` switches to universal ones itself.
        "checkpoint": {"load_universal": False, "tag_validation": "Warn"},
    }
    if device.mixed_precision:
        # Accumulate and reduce gradients in the dtype our DeviceSpec names (fp32), as FSDP2's
        # MixedPrecisionPolicy does; DeepSpeed would otherwise use the compute dtype.
        dtype = str(device.reduce_dtype).removeprefix("torch.")
        config["communication_data_type"] = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
        config["data_types"] = {"grad_accum_dtype": config["communication_data_type"]}
    # No "optimizer" and no "scheduler" section: the client optimizer is passed in, and the
    # learning rate is set on it every step from `lr_at`.
    return config


def _skip_shm_comm() -> None:
    """Keep DeepSpeed from JIT-building its shared-memory CPU collectives (~36 s cold).

    `TorchBackend` builds `deepspeed_shm_comm` whenever the op probes as compatible; marking it
    incompatible makes DeepSpeed use plain torch.distributed (gloo), as FSDP2 does.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def prepare_deepspeed(device: DeviceSpec, mpu=None) -> None:
    """Point DeepSpeed at the process group the actor already initialised, on this rank's
    device, with the parallel groups of `mpu` (DeepSpeed's "model parallel unit" protocol; the
    world is one DP group when None)."""
    import deepspeed

    # DeepSpeed picks its device from LOCAL_RANK; the actor has already selected it.
    os.environ.setdefault("LOCAL_RANK", str(device.index))
    if device.device_type != "cuda":  # host memory underneath: gloo, not DeepSpeed's shm ops
        _skip_shm_comm()
    if device.device_type in ("emu", "cpu"):
        from raytrain_dt.accel.emulated.deepspeed_accelerator import use_emulated_accelerator

        use_emulated_accelerator(device.device_type == "emu")
    # The actor initialised torch.distributed; this only wraps the existing default group.
    deepspeed.init_distributed(dist_backend=device.backend, dist_init_required=False)
    # DeepSpeed keeps its parallel groups in module globals and replaces the `mpu` only when
    # given one: an engine built earlier in this process (an actor reused for another layout)
    # would leave its groups, of a destroyed process group, in force.
    from deepspeed.utils import groups

    groups.mpu = mpu
    groups._WORLD_GROUP = None


def initialize_deepspeed(
    model: nn.Module, cfg: TrainConfig, ds_config: dict, device: DeviceSpec, mpu=None
) -> tuple:
    """(DeepSpeed engine, its optimizer) around `model` with our AdamW, on the process group
    the actor already initialised (`prepare_deepspeed`)."""
    import deepspeed

    prepare_deepspeed(device, mpu)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model,
        optimizer=build_adamw(model, cfg.trainer),
        config=ds_config,
        mpu=mpu,
        dist_init_required=False,
    )
    return engine, optimizer


@torch.no_grad()
def build_partitioned(
    spec: ModelSpec, max_seq_len: int, ds_config: dict, device: DeviceSpec, weights: WeightSource
) -> nn.Module:
    """ZeRO-3: the model partitioned over the DP ranks module by module as it is constructed
    (`zero.Init`: at most one module's parameters are ever whole, briefly), then each rank's
    partition of every parameter filled from `weights`. A partition is a flat range of the
    parameter (`ds_tensor`, padded at the end), read as the rows that cover it."""
    import deepspeed

    prepare_deepspeed(device)
    # mem_efficient_linear=False: leave torch's F.linear alone (the same kernel as FSDP2). No
    # dtype: the config's precision decides (DeepSpeed 0.19.8 ignores an explicit dtype where the
    # accelerator lacks fp16, the CPU's case, and partitions in bf16).
    partitioning = deepspeed.zero.Init(config_dict_or_path=ds_config, mem_efficient_linear=False)
    with partitioning:
        model = spec.instantiate(max_seq_len)
    for name, module, param in unique_parameters(model):
        part = param.ds_tensor
        start = part.ds_numel * param.ds_zero_partition_rank
        stop = min(start + part.ds_numel, param.ds_numel)
        if stop > start:
            shape = tuple(param.ds_shape)
            part[: stop - start].copy_(read_flat(weights, name, module, shape, start, stop))
    return model


class DeepSpeedEngine:
    # DeepSpeed writes its checkpoint files itself: no DCP writer to run in the background or
    # to replace (config validation refuses chaos `kill_rank_mid_save` for this engine).
    supports_async_save = False

    def __init__(self, build: EngineBuild):
        self.cfg = build.cfg
        self.layout = build.layout
        self.device = build.device
        self._loss = build.spec.loss_fn()
        self._initialize_deepspeed(build)
        self._dp_group = build.mesh["dp"].get_group()

    def _initialize_deepspeed(self, build: EngineBuild) -> None:
        """Build this rank's model (ZeRO-3: only its partition) and hand it to DeepSpeed. The
        pipeline engine overrides this to build and hand over its stages instead."""
        spec, cfg, layout, device = build.spec, build.cfg, build.layout, build.device
        self.ds_config = deepspeed_config(cfg, layout, device)
        weights = build.initial_weights()
        if layout.zero_stage == 3:
            model = build_partitioned(spec, cfg.data.seq_len, self.ds_config, device, weights)
        else:  # replicated parameters (ZeRO-0/1/2): the whole model on every rank, by design
            model = spec.build(cfg.data.seq_len, cfg.run.seed, device.torch_device, weights)
        if layout.activation_checkpointing:
            apply_activation_checkpointing(model, spec.blocks(model), keep_names=True)
        self._hand_to_deepspeed(model)

    def _hand_to_deepspeed(self, model: nn.Module, mpu=None) -> None:
        """Wrap `model` in a DeepSpeed engine with our optimizer (`self.ds_config`, the groups
        of `mpu`), recording its parameter names first: `full_state_dict` reports under them."""
        self._names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
        self.engine, self.optimizer = initialize_deepspeed(
            model, self.cfg, self.ds_config, self.device, mpu
        )

    def train_step(
        self, micro_batches: list[torch.Tensor], step: int, real: list[torch.Tensor] | None = None
    ) -> StepResult:
        """One optimizer step; `real` marks each micro-batch's real rows (needed when the
        layout pads, see `engines.micro_loss`)."""
        t = self.cfg.trainer
        lr = apply_lr_schedule(self.optimizer, t, step)
        if len(micro_batches) != self.engine.gradient_accumulation_steps():
            raise ValueError(
                f"got {len(micro_batches)} micro-batches, DeepSpeed was configured for "
                f"{self.engine.gradient_accumulation_steps()}"
            )
        # fp32 on the device: it enters the DP all-reduce.
        loss_sum = self.device.scalar()
        for tokens, rows in zip(micro_batches, real or [None] * len(micro_batches), strict=True):
            tokens = self.device.to_device(tokens)
            loss = micro_step_loss(self._loss, self.engine(tokens), tokens, rows, self.layout)
            # Scales by 1/GAS and reduces gradients only at the accumulation boundary.
            self.engine.backward(loss)
            if self.engine.is_gradient_accumulation_boundary() and self.layout.zero_stage == 0:
                # Without ZeRO, DeepSpeed clips but does not keep the norm; gradients are
                # already averaged over DP here, so the local norm is the global one.
                grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
                self._stage0_norm = float(torch.nn.utils.get_total_norm(grads, 2.0))
            # A no-op except at the boundary, where it clips and steps.
            self.engine.step()
            loss_sum += loss.detach().float()
        norm = self.engine.get_global_grad_norm()
        grad_norm = self._stage0_norm if self.layout.zero_stage == 0 else float(norm)
        # Every micro-batch has the same number of tokens (padding weighted as in
        # `micro_step_loss`), so the global-batch mean is the mean of the per-rank means over DP.
        global_loss = loss_sum / len(micro_batches)
        dist.all_reduce(global_loss, op=dist.ReduceOp.SUM, group=self._dp_group)
        return StepResult(loss=float(global_loss) / self.layout.dims.dp, grad_norm=grad_norm, lr=lr)

    # --- checkpoint state ----------------------------------------------------------------------
    def warm_up(self) -> None:
        """Nothing to pay ahead: DeepSpeed's first step has no one-time costs of ours."""

    def save(
        self, checkpoint_dir: str, digests: FileDigests | None = None, wrap_writer=None
    ) -> None:
        # Collective. Writes <dir>/ds/ (model states + per-rank ZeRO optimizer partitions).
        if wrap_writer is not None:
            raise NotImplementedError("DeepSpeed writes its own checkpoint files: no DCP writer")
        with StagedStep(checkpoint_dir) as staged:
            rank_0 = dist.get_rank() == 0
            with recording_saves(self.engine, staged.local, digests or FileDigests(), rank_0):
                self.engine.save_checkpoint(str(staged.local), tag=TAG)
            staged.upload()  # object storage: this rank's files, from its own staging dir

    def save_async(self, checkpoint_dir: str, process_group, digests=None, wrap_writer=None):
        raise NotImplementedError("DeepSpeed saves synchronously (supports_async_save is False)")

    def stage_copy(self, stager):
        raise NotImplementedError("DeepSpeed keeps no in-memory copies (supports_async_save)")

    def load(self, checkpoint_dir: str) -> None:
        with StagedStep(checkpoint_dir) as staged:
            self._load(checkpoint_dir, staged)

    def _load(self, checkpoint_dir: str, staged: StagedStep) -> None:
        path = staged.local
        staged.mirror(TAG)
        saved = saved_layout(path / TAG)
        current = (self.layout.dims.dp, self.layout.zero_stage == 3, self.layout.dims.pp)
        tag = TAG
        if saved is None and self.layout.zero_stage != 0 and (path / TAG).is_dir():
            raise ValueError(
                f"engine.zero_stage: {checkpoint_dir} was written with zero_stage=0 (no ZeRO "
                f"partitions); resume with zero_stage=0, not {self.layout.zero_stage}"
            )
        # The same DP size and stage count, but blocks moved between stages (another
        # `parallel.pp_layers`): DeepSpeed's stage files no longer match the stages either.
        moved = saved is not None and saved == current and self._stages_moved(path / TAG, staged)
        if saved is not None and (saved != current or moved):
            if self.layout.zero_stage == 0:
                raise ValueError(
                    f"{checkpoint_dir}: a ZeRO checkpoint (DP size {saved[0]}) cannot be loaded "
                    "at engine.zero_stage=0; use zero_stage >= 1"
                )
            if saved[1] != current[1]:
                # DeepSpeed 0.19.8's universal loader fails (no model-state files) when crossing
                # this boundary, so say so instead of failing inside DeepSpeed.
                raise ValueError(
                    f"engine.zero_stage: {checkpoint_dir} was written "
                    f"{'with' if saved[1] else 'without'} ZeRO-3; resume with "
                    f"zero_stage {'3' if saved[1] else '1 or 2'} (switching across ZeRO-3 is "
                    "not supported in this version)"
                )
            # Another DP size or pipeline split: DeepSpeed's own loader refuses it; the
            # universal format is layout-free. Converted once, by rank 0, next to the original.
            log.info(
                "resharding %s: DP %d -> %d, pp %d -> %d%s",
                checkpoint_dir,
                saved[0],
                current[0],
                saved[2],
                current[2],
                " (blocks moved between stages)" if moved else "",
            )
            tag = UNIVERSAL_TAG
            # Its model states are uploaded last: an interrupted upload is converted again.
            whole = MODEL_STATES.format(stage=0)
            if dist.get_rank() == 0 and not staged.mirror(UNIVERSAL_TAG, complete=whole):
                staged.fetch_all(TAG)  # the converter reads every rank's files
                staged.clear(UNIVERSAL_TAG)  # an interrupted conversion's (or upload's) files
                to_universal(path / TAG, path / UNIVERSAL_TAG)
                staged.upload(UNIVERSAL_TAG, last=whole)
            dist.barrier()
            # Layout-free: every rank reads every parameter's file (torch.load, directly).
            staged.mirror(UNIVERSAL_TAG)
            staged.fetch_all(UNIVERSAL_TAG)
            # Consulted only inside load_checkpoint (by the engine and the ZeRO optimizer).
            self.engine._config.load_universal_checkpoint = True
        # Hyperparameters come from our config, not the checkpoint. This also undoes a DeepSpeed
        # 0.19.8 bug: ZeRO-3's universal loader copies group 0's settings to every group, which
        # gives the no-decay group weight decay.
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        try:
            with fetching_loads(self.engine, staged):
                loaded, _ = self.engine.load_checkpoint(
                    str(path),
                    tag=tag,
                    load_optimizer_states=True,
                    load_lr_scheduler_states=False,
                    # A universal checkpoint's model states hold the whole model, a pipeline
                    # stage only its part (its weights come from the per-parameter files).
                    load_module_strict=tag == TAG or self.layout.dims.pp == 1,
                )
        finally:
            self.engine._config.load_universal_checkpoint = False
        for group, settings in zip(self.optimizer.param_groups, hyper, strict=True):
            group.update(settings)
        # Same loader: every ZeRO-3 sub-group gets the *same* `step` tensor, which torch's
        # foreach AdamW then increments once per sub-group per step (wrong bias correction).
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        for state in inner.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()
        if loaded is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint {tag!r} under {checkpoint_dir}")

    def _stages_moved(self, tag_dir: Path, staged: StagedStep) -> bool:
        """Whether a checkpoint of this layout's stage count holds other blocks per stage than
        this run's split (a file of `tag_dir` is read through `staged.fetch`); one stage cannot
        move (the pipeline engine overrides this)."""
        return False

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 master parameters by name (collective: ZeRO partitions are gathered)."""
        from deepspeed.utils import safe_get_full_fp32_param

        params = dict(self.engine.module.named_parameters(remove_duplicate=False))
        out = {}
        for name in self._names:
            full = safe_get_full_fp32_param(params[name])
            # Stage 0 keeps no separate master copy: the module's parameter is it.
            value = (params[name] if full is None else full).detach().float().cpu().clone()
            out[name] = value
        return out
