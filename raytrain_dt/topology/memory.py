"""Per-rank accelerator memory model, in bytes: model states, activations and a safety margin.

Pure arithmetic on a `ModelShape` and a `Layout` (no torch), so the planner can price thousands
of layouts in milliseconds. Model states follow the ZeRO paper (Rajbhandari et al. 2020) as
each engine implements it: FSDP2 and DeepSpeed differ in what they shard at which stage, keep
in fp32, hold unsharded while computing and accumulate without a reduction, and
bench/bench_memory.py checks both against the bytes the engines really hold. Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models"), held per micro-batch in flight as the pipeline schedule keeps them
(`pipeline_schedule.py`). Also home of `shape_for_params`, which invents a Llama-like shape for a
bare parameter count (dense, or a mixture of experts) so the planner can be asked about models
that have no preset.

Context parallelism (cp) splits every sequence over cp ranks: each holds seq_len/cp tokens'
activations, plus the ring's K/V buffers; FSDP2 shards the states over dp_shard x cp.
Expert parallelism (ep) splits each MoE block's routed experts over ep of the dp_shard ranks,
which FSDP2 then shards over the remaining dp_shard/ep (`parallel/device_mesh.expert_fsdp_mesh`;
cp ranks hold the same expert shards, whose gradients the engine sums over cp): a rank's
resident expert states are 1/dp_shard of them with or without ep, but the unsharded copy it
gathers for compute (and the gradients it holds before reducing them) is 1/ep of the experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from raytrain_dt.models.presets import ModelShape
from raytrain_dt.topology.layout import Layout
from raytrain_dt.topology.pipeline_schedule import live_peaks
from raytrain_dt.topology.pipeline_stages import (
    heaviest_rank_blocks,
    heaviest_rank_params,
    split_of,
)

GB = 1e9

# (param, grad, optimizer) bytes per parameter. Mixed precision keeps bf16 params and grads
# and an fp32 master copy plus Adam m and v (4+4+4); fp32 training needs no master copy.
STATE_BYTES: dict[str, tuple[int, int, int]] = {"bf16": (2, 2, 12), "fp32": (4, 4, 8)}
# Korthikanti's constants count 2-byte activations; fp32 runs store every one of them at 4.
ACTIVATION_SCALE: dict[str, float] = {"bf16": 1.0, "fp32": 2.0}
LOGIT_BYTES = 4  # the loss upcasts logits to fp32 whatever the compute precision
ENGINES = ("fsdp2", "deepspeed")
# DeepSpeed's reduce_bucket_size (elements), pinned in the config `deepspeed_config` generates.
DEEPSPEED_REDUCE_BUCKET = 500_000_000


def _check_precision(precision: str) -> None:
    if precision not in STATE_BYTES:
        raise ValueError(f"precision must be one of {', '.join(STATE_BYTES)}, got {precision!r}")


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak bytes on one accelerator (the heaviest pipeline stage), by category."""

    params: float
    grads: float
    optimizer: float
    activations: float
    margin: float
    total: float

    def as_gb(self) -> dict[str, float]:
        return {
            k: getattr(self, k) / GB
            for k in ("params", "grads", "optimizer", "activations", "margin", "total")
        }


def stage_params(shape: ModelShape, pp: int = 1, virtual_stages: int = 1, pp_layers=()) -> float:
    """Parameters held by the pp rank with the most (before TP or ZeRO division), for the split
    the pipeline code makes (`pipeline_stages.py`: the end stages carry the embedding and the
    head, and fewer blocks)."""
    return heaviest_rank_params(shape, pp, virtual_stages, pp_layers)


def stage_expert_params(
    shape: ModelShape, pp: int = 1, virtual_stages: int = 1, pp_layers=()
) -> float:
    """Routed-expert parameters among `stage_params` (before EP, TP or ZeRO division)."""
    if not shape.is_moe:
        return 0.0
    blocks = heaviest_rank_blocks(shape, pp, virtual_stages, pp_layers)
    return float(blocks * shape.expert_params_per_layer)


def _check_engine(engine: str) -> None:
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")


def resident_bytes_per_param(
    engine: str, precision: str, zero_stage: int, shard: int = 1
) -> tuple[float, float, float]:
    """(param, grad, optimizer) bytes per (stage-local) parameter `engine` holds at the step.

    FSDP2 shards all three at every stage >= 1 (grad-op differs from full sharding only in
    when it frees the all-gathered copy, see `working_state_bytes`). Its sharded parameters
    are fp32 and are the master copy, and gradients are reduced and kept in fp32, even under a
    bf16 MixedPrecisionPolicy: bf16 exists only in the all-gathered compute copy.

    DeepSpeed (measured on 0.19.8 with the config `deepspeed_config` generates): the module
    keeps the compute dtype, replicated below ZeRO-3. Every ZeRO stage clones an fp32 master
    partition, even at fp32, and steps on an fp32 gradient partition that it keeps beside the
    partition it reduced into (fp32 `grad_accum_dtype` at ZeRO-1/2, the compute dtype at
    ZeRO-3). Stage 0 is torch AdamW on the module (bf16 adds DeepSpeed's fp32 master copy).
    Full ZeRO-1 gradients live only during backward.
    """
    _check_engine(engine)
    _check_precision(precision)
    p_bytes, g_bytes, o_bytes = STATE_BYTES[precision]
    if engine == "fsdp2":
        divisor = shard if zero_stage >= 1 else 1
        return tuple(b / divisor for b in STATE_BYTES["fp32"])
    if zero_stage == 0:
        return p_bytes, g_bytes, o_bytes
    master_and_adam = (STATE_BYTES["fp32"][2] + 4) / shard
    if zero_stage == 3:
        return p_bytes / shard, (g_bytes + 4) / shard, master_and_adam
    return p_bytes, 8 / shard, master_and_adam


def model_state_bytes(
    shape: ModelShape,
    *,
    tp: int = 1,
    pp: int = 1,
    shard: int = 1,
    zero_stage: int = 0,
    precision: str = "bf16",
    engine: str = "fsdp2",
    offload_optimizer: bool = False,
    offload_params: bool = False,
    virtual_stages: int = 1,
    pp_layers=(),
    cp: int = 1,
    ep: int = 1,
) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per rank at the optimizer step; `shard` is the
    ZeRO/FSDP degree (dp_shard). These are the sharded states only (`resident_bytes_per_param`);
    `estimate_memory` adds the transient buffers of forward and backward. FSDP2 shards the
    non-expert states over dp_shard x `cp` (at zero 0 over cp alone), and a rank's `ep`-th of
    the routed experts over dp_shard / ep, the same on every cp rank (the module docstring)."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0..3, got {zero_stage}")
    split = (shape, pp, virtual_stages, pp_layers)
    experts = stage_expert_params(*split) / tp
    dense = stage_params(*split) / tp - experts
    # FSDP2's mesh of the non-expert states takes in the cp ranks (dp_shard x cp); the experts'
    # (dp_shard / ep) does not: an expert mesh lists its axes in the root mesh's order, where
    # cp comes after ep.
    over_cp = cp if engine == "fsdp2" else 1
    dense_bytes = resident_bytes_per_param(engine, precision, zero_stage, shard)
    params, grads, optimizer = (dense * b / over_cp for b in dense_bytes)
    if experts:
        expert_bytes = resident_bytes_per_param(engine, precision, zero_stage, max(1, shard // ep))
        params, grads, optimizer = (
            total + experts / ep * b
            for total, b in zip((params, grads, optimizer), expert_bytes, strict=True)
        )
    # FSDP2's CPUOffloadPolicy (engine.offload_optimizer) moves the parameter and gradient
    # shards to the host too; they stay priced here as well (conservative: each block's are
    # streamed back for its compute). `host_memory.py` prices their host side.
    # Offloaded states live in host memory; the accelerator only streams them.
    return (0.0 if offload_params else params), grads, (0.0 if offload_optimizer else optimizer)


def working_state_bytes(
    shape: ModelShape,
    *,
    tp: int = 1,
    pp: int = 1,
    shard: int = 1,
    zero_stage: int = 0,
    precision: str = "bf16",
    engine: str = "fsdp2",
    grad_accum: int = 1,
    defer_grad_sync: bool = False,
    virtual_stages: int = 1,
    pp_layers=(),
    cp: int = 1,
    ep: int = 1,
) -> tuple[float, float]:
    """(params, grads) bytes held on top of `model_state_bytes` during forward and backward.
    Under expert parallelism a rank gathers and differentiates only its `ep`-th of the routed
    experts; context parallelism changes none of it (every cp rank computes the whole block).

    FSDP2 (also at shard size 1, where the all-gather is a copy): full sharding keeps the
    running and the prefetched block plus the root (embedding, final norm, head: never
    resharded after forward) unsharded in the compute dtype; grad-op, and any stage under a
    pipeline schedule, keeps every block's all-gathered copy from its forward to its backward.
    Gradients exist unsharded (fp32) for one block until its reduce-scatter, but stages 0 and 1
    accumulate without sync, like ZeRO-1 (and a pipeline schedule always does), so there every
    unsharded gradient stays until the last micro-step reduces it.
    DeepSpeed: ZeRO-3 gathers the running and the prefetched layer and holds one layer's full
    gradient; ZeRO-1 accumulates full gradients until the boundary reduces them; ZeRO-2 reduces
    into its partition every micro-step, and stage 0 holds full gradients already.
    """
    _check_engine(engine)
    _check_precision(precision)
    compute_bytes, grad_bytes = STATE_BYTES[precision][0], STATE_BYTES[precision][1]
    split = {"virtual_stages": virtual_stages, "pp_layers": pp_layers}
    idle = 1.0 - 1.0 / ep  # the share of the routed experts other EP ranks hold
    local = (stage_params(shape, pp, **split) - idle * stage_expert_params(shape, pp, **split)) / tp
    layer = (shape.params_per_layer - idle * shape.expert_params_per_layer) / tp
    if engine == "fsdp2":
        # A pipeline schedule keeps its stages unsharded and unsynced across all micro-batches
        # (torch.distributed.pipelining turns off resharding after backward and the reduce).
        # At zero 2/3 deferring is the layout's choice (`Layout.defer_grad_sync`).
        deferred = (grad_accum > 1 and (zero_stage <= 1 or defer_grad_sync)) or pp > 1
        if zero_stage == 3 and pp == 1:
            root = local - shape.n_layers * layer
            params = (root + 2 * layer) * compute_bytes
        else:
            params = local * compute_bytes
        if not deferred:
            return params, layer * 4.0
        # The sharded gradients appear only as the last micro-step frees the unsharded ones.
        resident = model_state_bytes(
            shape,
            tp=tp,
            pp=pp,
            shard=shard,
            zero_stage=zero_stage,
            engine=engine,
            cp=cp,
            ep=ep,
            **split,
        )[1]
        return params, local * 4.0 - resident
    if zero_stage == 3:
        return 2 * layer * compute_bytes, layer * grad_bytes
    # ZeRO-1/2 stage each micro-step's gradients in one fp32 reduce bucket of
    # `reduce_bucket_size` elements, allocated whole during backward.
    bucket = DEEPSPEED_REDUCE_BUCKET * 4.0 if zero_stage in (1, 2) else 0.0
    if zero_stage == 1:
        # Gradients also accumulate unpartitioned (fp32, `grad_accum_dtype`) until the boundary.
        return 0.0, bucket + local * 4.0 - local * 4.0 / shard
    return 0.0, bucket


def korthikanti_layer_bytes(
    seq_len: int,
    micro_batch: int,
    dim: int,
    n_heads: int,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    fused_attention: bool = True,
    mlp_scale: float = 1.0,
) -> float:
    """Activation bytes one transformer layer stores for backward (Korthikanti et al. 2022).

    No parallelism: sbh(34 + 5as/h). TP with SP: sbh(34 + 5as/h)/t. TP without SP leaves the
    layer norms' and dropouts' 10sbh replicated: sbh(10 + 24/t + 5as/(ht)). A fused attention
    kernel (SDPA/flash) never materialises the a*s*s score matrix, so its 5as/h term goes.
    `mlp_scale` scales the MLP's 19sbh (a routed MoE block: `mlp_activation_scale`). `seq_len`
    may be a fraction (a cp rank's share of the sequence).
    """
    sbh = float(seq_len) * micro_batch * dim
    attention = 0.0 if fused_attention else 5.0 * n_heads * seq_len / dim
    routed = 19.0 * (mlp_scale - 1.0)
    if tp == 1 or sequence_parallel:
        return sbh * (34.0 + routed + attention) / tp
    return sbh * (10.0 + (24.0 + routed) / tp + attention / tp)


def mlp_activation_scale(shape: ModelShape) -> float:
    """A block's MLP activations against a dense SwiGLU of `ffn_hidden`: a MoE block runs every
    token through `experts_per_token` experts of `expert_hidden` (and the shared expert), so it
    stores about that many times the hidden activations."""
    if not shape.is_moe:
        return 1.0
    routed = shape.experts_per_token * shape.expert_hidden + shape.shared_ffn_hidden
    return routed / shape.ffn_hidden


def ring_buffer_bytes(
    shape: ModelShape, *, seq_len: int, micro_batch: int, cp: int, tp: int = 1, scale: float = 1.0
) -> float:
    """The ring's transient K/V buffers on a cp rank (one layer at a time): the K and V of its
    seq_len/cp tokens in flight both ways (send and receive), and in backward as many again
    for dK and dV. TP splits the KV heads. 0 without context parallelism."""
    if cp <= 1:
        return 0.0
    kv = 2.0 * seq_len / cp * micro_batch * shape.n_kv_heads * shape.head_dim / tp
    return 2.0 * 2.0 * kv * 2.0 * scale


def activation_bytes(
    shape: ModelShape,
    *,
    seq_len: int,
    micro_batch: int,
    tp: int = 1,
    pp: int = 1,
    grad_accum: int = 1,
    sequence_parallel: bool = False,
    activation_checkpointing: bool = False,
    fused_attention: bool = True,
    precision: str = "bf16",
    virtual_stages: int = 1,
    pp_layers=(),
    pp_schedule: str = "1f1b",
    cp: int = 1,
) -> float:
    """Peak activation bytes on the pp rank whose live activations peak highest under
    `pp_schedule` (`grad_accum` micro-batches per step). `estimate_memory` adds them to the
    states of the rank with the most parameters: an upper bound where the two ranks differ.
    A cp rank holds seq_len/cp tokens of each sequence (everything below is linear in them:
    fused attention stores no score matrix), plus the ring's K/V buffers (`ring_buffer_bytes`)."""
    _check_precision(precision)
    scale = ACTIVATION_SCALE[precision]
    ring = ring_buffer_bytes(
        shape, seq_len=seq_len, micro_batch=micro_batch, cp=cp, tp=tp, scale=scale
    )
    seq_len = seq_len / cp
    layer = (
        korthikanti_layer_bytes(
            seq_len,
            micro_batch,
            shape.dim,
            shape.n_heads,
            tp=tp,
            sequence_parallel=sequence_parallel,
            fused_attention=fused_attention,
            mlp_scale=mlp_activation_scale(shape),
        )
        * scale
    )
    if activation_checkpointing:
        # Only each layer's input survives the forward (sharded over TP under SP); backward
        # recomputes one layer at a time, so one full layer's working set is added once.
        kept = 2.0 * seq_len * micro_batch * shape.dim * ACTIVATION_SCALE[precision]
        per_block, working = (kept / tp if sequence_parallel else kept), layer
    else:
        per_block, working = layer, 0.0
    logits = float(seq_len) * micro_batch * shape.vocab_size / tp * LOGIT_BYTES
    working += ring
    if pp == 1:
        # Gradient accumulation runs each micro-batch's backward before the next forward.
        return shape.n_layers * per_block + working + logits
    # The rank whose live activations peak highest, replaying the schedule's own order of
    # forwards and backwards on every rank (`pipeline_schedule.py`): 1F1B's stage i holds
    # pp - i micro-batches, the interleaved first rank pp * v + pp - 1 chunks; the last stage
    # also keeps each live micro-batch's logits for the loss's backward.
    counts = split_of(shape, pp, virtual_stages, pp_layers)
    peaks = live_peaks(tuple(counts), pp, grad_accum, pp_schedule)
    return max(blocks * per_block + last * logits for blocks, last in peaks) + working


def layout_degrees(layout: Layout) -> dict:
    """The keyword arguments `model_state_bytes` and `working_state_bytes` take from a layout:
    what splits and shards the model's states on a rank."""
    d = layout.dims
    return {
        "tp": d.tp,
        "pp": d.pp,
        "shard": d.dp_shard,
        "zero_stage": layout.zero_stage,
        "virtual_stages": layout.virtual_stages,
        "pp_layers": layout.pp_layers,
        "cp": d.cp,
        "ep": d.ep,
    }


def estimate_memory(
    shape: ModelShape,
    layout: Layout,
    *,
    seq_len: int,
    precision: str = "bf16",
    margin: float = 0.10,
    fused_attention: bool = True,
    offload_params: bool = False,
    engine: str = "fsdp2",
) -> MemoryEstimate:
    """Peak per-rank bytes for `layout`. `margin` is a fraction of the *total* (fragmentation,
    NCCL and cuBLAS workspaces): total = (states + activations) / (1 - margin)."""
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
    d = layout.dims
    degrees = layout_degrees(layout)
    params, grads, optimizer = model_state_bytes(
        shape,
        **degrees,
        precision=precision,
        engine=engine,
        offload_optimizer=layout.offload_optimizer,
        offload_params=offload_params,
    )
    working_params, working_grads = working_state_bytes(
        shape,
        **degrees,
        precision=precision,
        engine=engine,
        grad_accum=layout.grad_accum,
        defer_grad_sync=layout.defer_grad_sync,
    )
    params += working_params
    grads += working_grads
    activations = activation_bytes(
        shape,
        seq_len=seq_len,
        micro_batch=layout.micro_batch,
        tp=d.tp,
        pp=d.pp,
        virtual_stages=layout.virtual_stages,
        pp_layers=layout.pp_layers,
        pp_schedule=layout.pp_schedule,
        grad_accum=layout.grad_accum,
        sequence_parallel=layout.sequence_parallel,
        activation_checkpointing=layout.activation_checkpointing,
        fused_attention=fused_attention,
        precision=precision,
        cp=d.cp,
    )
    used = params + grads + optimizer + activations
    total = used / (1.0 - margin)
    return MemoryEstimate(params, grads, optimizer, activations, total - used, total)


def shape_for_params(
    n: float, vocab_size: int = 32000, experts: int = 0, active: int = 0
) -> ModelShape:
    """A Llama-like shape with about `n` parameters (within one layer's worth); with `experts`,
    a Mixtral-like mixture of experts whose every block routes each token to `active` of them.

    Llama 1-3 keep depth near dim/128 (7B: 4096/32, 13B: 5120/40, 70B: 8192/80; Mixtral too),
    head_dim 128 and ffn ~ 8/3 dim; we scan dims, fit the layer count to `n`, and keep the
    dim whose depth is closest to that aspect ratio. GQA with 8 KV heads from 64 heads up.
    """
    if n <= 0:
        raise ValueError(f"parameter count must be positive, got {n}")
    if experts and not 1 <= active <= experts:
        raise ValueError(f"active experts must be in 1..{experts}, got {active}")
    moe = {"n_experts": experts, "experts_per_token": active} if experts else {}
    best: tuple[float, int, ModelShape] | None = None
    # Above 4096 step by 1024 so head counts stay multiples of 8 (TP up to 8 divides them).
    for dim in [*range(256, 4096, 256), *range(4096, 32768 + 1, 1024)]:
        head_dim = 128 if dim >= 1024 else 64
        n_heads = dim // head_dim
        n_kv_heads = 8 if n_heads >= 64 else n_heads
        ffn = max(256, round(8 * dim / 3 / 256) * 256)
        probe = ModelShape(dim, 1, n_heads, n_kv_heads, vocab_size, ffn, **moe)
        fixed = probe.num_params - probe.params_per_layer
        layers = max(1, round((n - fixed) / probe.params_per_layer))
        # Ratio distance on a log scale, so too deep and too shallow weigh alike.
        score = abs(math.log(layers * 128.0 / dim))
        if best is None or score < best[0]:
            shape = ModelShape(dim, layers, n_heads, n_kv_heads, vocab_size, ffn, **moe)
            best = (score, dim, shape)
    assert best is not None
    return best[2]
