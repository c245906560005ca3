"""What the user may fix of a layout, and what no layout may be: `LayoutPins` from the config,
`validate_pins` (a one-line ConfigError naming the key for a pin nothing can honour),
`model_refusal` (context or expert parallelism the model has no structure for) and
`engine_refusal` (the degree combinations an engine cannot run). The planner searches only
inside these bounds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from raytrain_dt.errors import ConfigError
from raytrain_dt.models.presets import ModelShape
from raytrain_dt.topology.layout import Topology
from raytrain_dt.topology.pipeline_stages import pp_layers_refusal


@dataclass(frozen=True)
class LayoutPins:
    """Choices fixed by the user; None means the planner decides."""

    tp: int | None = None
    pp: int | None = None
    dp_replicate: int | None = None
    dp_shard: int | None = None
    zero_stage: int | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None
    activation_checkpointing: bool | None = None
    offload_optimizer: bool | None = None
    sequence_parallel: bool | None = None
    pp_schedule: str | None = None
    virtual_stages: int | None = None
    grad_sync: str | None = None  # final / every; None: the planner chooses
    pp_layers: tuple[int, ...] | None = None  # blocks per stage; None: balanced by cost
    cp: int | None = None  # context parallel: each sequence split over cp ranks
    ep: int | None = None  # expert parallel: each MoE block's experts split over ep dp_shard ranks

    @classmethod
    def from_config(cls, cfg) -> LayoutPins:
        """Pins from a `TrainConfig`. Boolean switches default to False in the config, so only
        True pins them; False leaves the choice to the planner."""
        p, e, t = cfg.parallel, cfg.engine, cfg.trainer
        flag = {
            "activation_checkpointing": t.activation_checkpointing,
            "offload_optimizer": e.offload_optimizer,
        }
        return cls(
            tp=p.tp,
            pp=p.pp,
            dp_replicate=p.dp_replicate,
            dp_shard=p.dp_shard,
            zero_stage=e.zero_stage,
            micro_batch=t.micro_batch,
            grad_accum=t.grad_accum,
            pp_schedule=p.pp_schedule,
            virtual_stages=p.virtual_stages,
            grad_sync=None if e.grad_sync == "auto" else e.grad_sync,
            pp_layers=tuple(p.pp_layers) if p.pp_layers else None,
            cp=p.cp,
            ep=p.ep,
            # Pinned both ways: a layout may only claim sequence parallelism the engine applies.
            sequence_parallel=p.sequence_parallel,
            **{k: True if v else None for k, v in flag.items()},
        )


_POSITIVE_PINS = {
    "tp": "parallel.tp",
    "pp": "parallel.pp",
    "dp_replicate": "parallel.dp_replicate",
    "dp_shard": "parallel.dp_shard",
    "micro_batch": "trainer.micro_batch",
    "grad_accum": "trainer.grad_accum",
    "virtual_stages": "parallel.virtual_stages",
    "cp": "parallel.cp",
    "ep": "parallel.ep",
}


def engine_refusal(
    engine: str,
    tp: int | None,
    pp: int | None,
    zero_stage: int | None,
    precision: str = "fp32",
    cp: int | None = None,
    ep: int | None = None,
    moe: bool = False,
) -> str | None:
    """Why `engine` cannot run these degrees (of a mixture-of-experts model when `moe`), as one line naming the config keys; None if it can.

    DeepSpeed runs ZeRO data parallelism, and ZeRO-1 under pipeline parallelism (our pipeline
    schedules, every `parallel.pp_schedule`; DeepSpeed shards each stage's optimizer over its
    DP group, as its own pipeline engine does). No tensor parallelism, and no ZeRO-2/3 with a
    pipeline: they would reduce or gather every stage's gradients and parameters per
    micro-batch. ZeRO-0 with a pipeline is not implemented: ZeRO-1 moves the same gradient
    volume per step and holds less. ZeRO-0 in bf16 neither: DeepSpeed accumulates bf16
    gradients in fp32 (our numerics, as FSDP2's) only in its ZeRO optimizer, and refuses
    the mix without it (found on an H200; the CPU runs fp32). An unpinned zero_stage (None)
    is the planner's to choose. Context and expert parallelism are built for FSDP2 only:
    DeepSpeed has its own (Ulysses sequence parallelism, DeepSpeed-MoE), not wired in here.
    """
    if engine != "deepspeed":
        return None
    if moe:
        # Not only ep > 1: our MoE block's routing statistics and load-balancing loss are
        # wired into the FSDP2 engine's step only.
        return (
            "engine.name: deepspeed does not train mixture-of-experts models in this project "
            "(DeepSpeed-MoE is not wired in); use engine.name=fsdp2"
        )
    for key, degree, theirs in (
        ("cp", cp, "Ulysses sequence parallelism"),
        ("ep", ep, "DeepSpeed-MoE expert parallelism"),
    ):
        if (degree or 1) > 1:
            return (
                f"parallel.{key}: {degree} is not supported with engine.name=deepspeed "
                f"(DeepSpeed's own {theirs} is not wired into this project); use "
                f"engine.name=fsdp2 or parallel.{key}=1"
            )
    if (tp or 1) > 1:
        return (
            f"parallel.tp: {tp} is not supported with engine.name=deepspeed (ZeRO data and "
            "pipeline parallelism only); use engine.name=fsdp2 for tensor parallelism"
        )
    if (pp or 1) > 1 and zero_stage is not None and zero_stage != 1:
        return (
            f"engine.zero_stage: {zero_stage} cannot be combined with parallel.pp={pp} under "
            "engine.name=deepspeed: pipeline parallelism runs with ZeRO-1 only"
        )
    if zero_stage == 0 and precision == "bf16":
        return (
            "engine.zero_stage: 0 is not supported with engine.name=deepspeed at "
            "engine.precision=bf16 (DeepSpeed accumulates bf16 gradients in fp32 only in its "
            "ZeRO optimizer); use engine.zero_stage=1, the same training with the optimizer "
            "states sharded"
        )
    return None


def engine_pins(engine: str, pins: LayoutPins) -> LayoutPins:
    """The pins a run on `engine` plans with: DeepSpeed runs pipeline stages only when
    `parallel.pp` asks for them, so an unpinned pp is 1 there. Training (`run_plan`) and
    `raytrain-dt plan --engine` share this, so both give the same answer."""
    if engine != "fsdp2":
        # Nor context or expert parallelism (`engine_refusal`): unpinned, they are 1 there.
        unpinned = {k: 1 for k in ("pp", "cp", "ep") if getattr(pins, k) is None}
        return dataclasses.replace(pins, **unpinned)
    return pins


def model_refusal(shape: ModelShape, pins: LayoutPins, cp_attention: bool = True) -> str | None:
    """Why the model has no structure for the pinned cp or ep (or tp: the tensor-parallel plan
    covers dense blocks only), as one line naming the key; None if it has. `cp_attention`: the model's attention can run on a sequence split over cp ranks
    (our Llama decoder; not a `model.hf` model)."""
    cp, ep, tp = pins.cp or 1, pins.ep or 1, pins.tp or 1
    if tp > 1 and shape.is_moe:
        return (
            f"parallel.tp: {tp} is not built for mixture-of-experts blocks (model.n_experts="
            f"{shape.n_experts}): their experts are split by parallel.ep; use parallel.tp=1"
        )
    if ep > 1 and not shape.is_moe:
        return f"parallel.ep: {ep} needs a mixture-of-experts model; model.n_experts is 0"
    if shape.is_moe and shape.n_experts % ep:
        return f"parallel.ep: {ep} does not divide model.n_experts={shape.n_experts}"
    if cp > 1 and not cp_attention:
        return (
            f"parallel.cp: {cp} needs context-parallel attention, which model.hf models do not "
            "have (only the built-in Llama decoder splits a sequence over cp ranks); use "
            "parallel.cp=1"
        )
    return None


def context_parallel_refusal(cp: int, seq_len: int) -> str | None:
    """Why `cp` cannot split `seq_len`: ring attention cuts each sequence into 2 x cp chunks
    (each rank takes one from each end, which balances the causal mask's work)."""
    if cp > 1 and seq_len % (2 * cp):
        return (
            f"parallel.cp: {cp} does not split data.seq_len={seq_len} into 2 x cp = {2 * cp} "
            "equal chunks"
        )
    return None


def validate_pins(
    shape: ModelShape,
    topo: Topology,
    pins: LayoutPins,
    global_batch: int,
    engine: str,
    precision: str = "fp32",
    seq_len: int | None = None,
    cp_attention: bool = True,
) -> None:
    """ConfigError naming the config key for a pin no layout could honour."""
    for attr, key in _POSITIVE_PINS.items():
        value = getattr(pins, attr)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ConfigError(f"{key}: must be a positive int, got {value!r}")
    per_node, n, gb = topo.accelerators_per_node, topo.num_accelerators, global_batch
    tp, pp, mb, ga, z = pins.tp, pins.pp, pins.micro_batch, pins.grad_accum, pins.zero_stage
    degrees = [(a, getattr(pins, a)) for a in ("tp", "cp", "pp", "dp_replicate", "dp_shard")]
    degrees = [(a, v) for a, v in degrees if v is not None]
    product = 1
    for _, v in degrees:
        product *= v
    dp = (pins.dp_replicate or 1) * (pins.dp_shard or 1)
    v, sched = pins.virtual_stages or 1, pins.pp_schedule or "1f1b"
    stages = pp or len(pins.pp_layers or ()) // v
    layers_refusal = pp_layers_refusal(pins.pp_layers, shape.n_layers, stages, v)
    ep, ds = pins.ep or 1, pins.dp_shard
    # EP borrows dp_shard ranks: what the other degrees leave of the cluster must hold ep of them.
    room = n // max(1, (tp or 1) * (pp or 1) * (pins.cp or 1) * (pins.dp_replicate or 1))
    # (broken, message) in order: the first broken rule is reported.
    rules = [
        (
            tp and per_node % tp,
            f"parallel.tp: {tp} does not divide cluster accelerators per node ({per_node})",
        ),
        (
            tp and shape.n_heads % tp,
            f"parallel.tp: {tp} does not divide model.n_heads ({shape.n_heads})",
        ),
        (
            tp and shape.n_kv_heads % tp,
            f"parallel.tp: {tp} does not divide model.n_kv_heads ({shape.n_kv_heads})",
        ),
        (
            pp and pp * v > shape.n_layers,
            f"parallel.pp: {pp} x parallel.virtual_stages {v} = {(pp or 1) * v} stages exceed "
            f"model.n_layers ({shape.n_layers}): every stage needs a layer",
        ),
        (layers_refusal, layers_refusal),
        (
            product > n,
            f"parallel.{degrees[-1][0] if degrees else 'tp'}: "
            + " x ".join(f"{a}({v})" for a, v in degrees)
            + f" = {product} exceeds the cluster's {n} accelerators",
        ),
        (
            ds and ds % ep,
            f"parallel.ep: {ep} does not divide parallel.dp_shard ({ds}): expert parallelism "
            "splits the experts over dp_shard ranks",
        ),
        (
            not ds and ep > room,
            f"parallel.ep: {ep} exceeds the {room} dp_shard ranks the cluster's {n} "
            "accelerators leave beside the other degrees",
        ),
        (
            ep > 1 and z == 0,
            f"parallel.ep: {ep} needs sharded data parallelism (engine.zero_stage >= 1); "
            "engine.zero_stage is 0",
        ),
        (z not in (None, 0, 1, 2, 3), f"engine.zero_stage: {z!r} is not one of 0, 1, 2, 3"),
        (
            z == 0 and (pins.dp_shard or 1) > 1,
            f"engine.zero_stage: 0 (plain DP) needs parallel.dp_shard=1, got {pins.dp_shard}",
        ),
        (
            z == 0 and pins.offload_optimizer,
            "engine.offload_optimizer: needs engine.zero_stage >= 1, got 0",
        ),
        (mb and gb % mb, f"trainer.micro_batch: {mb} does not divide trainer.global_batch ({gb})"),
        (ga and gb % ga, f"trainer.grad_accum: {ga} does not divide trainer.global_batch ({gb})"),
        (
            mb and ga and gb % (mb * ga),
            f"trainer.grad_accum: micro_batch({mb}) x grad_accum({ga}) "
            f"does not divide trainer.global_batch ({gb})",
        ),
        (
            pins.dp_replicate and pins.dp_shard and gb % dp,
            f"parallel.dp_shard: dp = {dp} does not divide trainer.global_batch ({gb})",
        ),
        (
            v > 1 and sched != "interleaved",
            f"parallel.virtual_stages: {v} needs parallel.pp_schedule=interleaved, got {sched}",
        ),
    ]
    for broken, message in rules:
        if broken:
            raise ConfigError(message)
    refusal = (
        model_refusal(shape, pins, cp_attention)
        or context_parallel_refusal(pins.cp or 1, seq_len or 0)
        or engine_refusal(engine, tp, pp, z, precision, pins.cp, pins.ep, moe=shape.is_moe)
    )
    if refusal:
        raise ConfigError(refusal)
