"""Step-time model: compute at a calibrated efficiency plus alpha-beta communication and bubble.

Arithmetic only, so the planner can rank thousands of layouts. Collectives use the ring
alpha-beta model (time = steps * latency + volume / bandwidth), the same for every layout, so
the comparison between layouts is fair even where the constants are rough. TP and PP traffic
sits on the critical path and counts in full; data-parallel traffic overlaps the compute it
runs beside (DDP buckets behind the last backward, ZeRO-2 reduce-scatters behind every
backward, FSDP prefetches behind forward and backward), and only what does not fit in that
window is exposed. Overlap is not free: collectives running beside GEMMs take SMs and HBM
bandwidth from them, so every hidden second still costs OVERLAP_TAX of a second. That is what
makes more data-parallel volume slower even when all of it hides (ZeRO-3 behind ZeRO-2 behind
plain DP). `dp_comm_s` is what DP traffic adds to the step; `dp_hidden_s` what was overlapped.
The constants taken from measurements (GEMM efficiency by width, the bus bandwidth NCCL reaches,
the cost of recomputation) live in `calibration.py`, checked against published runs.

Context parallelism (ring attention): every layer passes each rank's K/V chunk round the cp
ring, cp - 1 hops in forward, and in backward the K/V again plus their gradients. Each hop's
transfer runs while the attention kernel works on the chunk in hand, so it hides behind the
attention's share of the compute (not the MLP's), at OVERLAP_TAX; only the rest is exposed.
Expert parallelism: every MoE block's dispatch and combine all-to-alls (two in forward, two in
backward, two more when checkpointing repeats the forward) move each token's k routed copies,
(ep - 1)/ep of them to other ranks; they sit on the critical path (the next GEMM needs them).
Both groups are priced on NVLink while they fit in a node and on the network once they span
nodes (`_link`).
"""

from __future__ import annotations

from dataclasses import dataclass

from raytrain_dt.models.presets import ModelShape
from raytrain_dt.topology.calibration import (
    INTER_NODE_BUS_EFFICIENCY,
    INTRA_NODE_BUS_EFFICIENCY,
    RECOMPUTE_FACTOR,
    accelerator_for_peak,
    compute_efficiency,
)
from raytrain_dt.topology.layout import Layout, Topology
from raytrain_dt.topology.memory import STATE_BYTES, stage_expert_params, stage_params
from raytrain_dt.topology.pipeline_stages import busiest_rank, busiest_rank_share

# Host link and CPU Adam rate for optimizer offload (PCIe Gen4 x16, DeepSpeed CPU Adam per rank).
PCIE_BANDWIDTH = 25e9
CPU_ADAM_PARAMS_PER_S = 1e9
# Slowdown of compute per second of communication overlapped with it (SM and HBM contention).
OVERLAP_TAX = 0.1


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step on the slowest rank, by cause."""

    compute_s: float
    dp_comm_s: float
    tp_comm_s: float
    pp_comm_s: float
    bubble_s: float
    total_s: float
    offload_s: float = 0.0
    dp_hidden_s: float = 0.0  # DP traffic overlapped with compute: not part of total_s
    cp_comm_s: float = 0.0  # the ring's K/V traffic that attention does not hide
    ep_comm_s: float = 0.0  # MoE dispatch and combine all-to-alls
    cp_hidden_s: float = 0.0  # ring traffic overlapped with attention: not part of total_s

    def as_dict(self) -> dict[str, float]:
        return {
            k: getattr(self, k)
            for k in (
                "compute_s",
                "dp_comm_s",
                "tp_comm_s",
                "cp_comm_s",
                "ep_comm_s",
                "pp_comm_s",
                "bubble_s",
                "offload_s",
                "dp_hidden_s",
                "cp_hidden_s",
                "total_s",
            )
        }


# `StepTime` fields that say what was overlapped, not what the step takes.
HIDDEN_KEYS = ("dp_hidden_s", "cp_hidden_s")


def all_reduce_s(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce: 2(n-1)/n of the buffer crosses each link, in 2(n-1) steps."""
    if n <= 1:
        return 0.0
    return 2.0 * (n - 1) / n * nbytes / bandwidth + 2.0 * (n - 1) * latency


def reduce_scatter_s(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Ring reduce-scatter of an `nbytes` buffer (each rank ends with nbytes/n)."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / bandwidth + (n - 1) * latency


# An all-gather producing an `nbytes` buffer moves exactly what a reduce-scatter moves.
all_gather_s = reduce_scatter_s


def _link(topology: Topology, span: int) -> tuple[float, float]:
    """(bandwidth, latency) for a group whose ranks fill `span` consecutive ranks.

    Ranks are ordered by node, so a group stays on NVLink iff its span fits in one node. The
    bandwidth is what a ring collective reaches of the link (`calibration.py`).
    """
    if span <= topology.accelerators_per_node and topology.accelerators_per_node % span == 0:
        return _intra(topology)
    return topology.inter_node_bandwidth * INTER_NODE_BUS_EFFICIENCY, topology.inter_node_latency


def _intra(topology: Topology) -> tuple[float, float]:
    return topology.intra_node_bandwidth * INTRA_NODE_BUS_EFFICIENCY, topology.intra_node_latency


def dp_comm_s(
    shape: ModelShape, layout: Layout, topology: Topology, precision: str
) -> tuple[float, float]:
    """(seconds of gradient sync and ZeRO-3 gathers per step, fraction of compute they can hide
    behind).

    zero 0: one all-reduce per step (gradients accumulate locally), behind the last micro-step's
    backward. zero 1: reduce-scatter + all-gather of the updated params once per step - the same
    volume - of which only the reduce-scatter hides. zero 2: gradients are sharded, so every
    micro-step reduce-scatters behind its backward, plus the exposed param all-gather per step.
    zero 3: every micro-step all-gathers params for forward and again for backward and
    reduce-scatters gradients, all prefetched behind compute. With HSDP the sharded ops stay in
    the dp_shard group and the shards' gradients are all-reduced across dp_replicate after each
    reduce-scatter. Context parallel ranks join the shard group (FSDP2's dp_shard x cp mesh; at
    zero 0 they are its only shards); a rank's routed experts are sharded over dp_shard/ep and
    the same on every cp rank, so their gradients are also all-reduced over cp (`memory.py`).
    """
    d = layout.dims
    if d.dp * d.cp == 1:
        return 0.0, 0.0
    rs, ag, replica = _dp_collectives(shape, layout, topology, precision)
    m, z = layout.grad_accum, layout.zero_stage
    backward_last = (2.0 / 3.0) / m  # share of compute that is the last micro-step's backward
    if z == 0:
        return rs + replica + ag, backward_last
    # Deferred sync (`Layout.defer_grad_sync`) reduces once, behind the last backward.
    syncs = 1 if layout.defer_grad_sync else m
    if z == 3:
        return m * 2 * ag + syncs * (rs + replica), 1.0
    if z == 2:
        return syncs * (rs + replica) + ag, (backward_last if syncs == 1 else 2.0 / 3.0)
    return rs + replica + ag, backward_last


def _dp_collectives(
    shape: ModelShape, layout: Layout, topology: Topology, precision: str
) -> tuple[float, float, float]:
    """Seconds of one gradient reduce-scatter, one parameter all-gather and one replica
    all-reduce of the heaviest rank's states, over the groups that shard and replicate them."""
    d = layout.dims
    p_bytes, g_bytes, _ = STATE_BYTES[precision]
    experts = _local_expert_params(shape, layout)
    shard_link = _link(topology, d.tp * d.cp * d.dp_shard)
    rep_link = _link(topology, d.tp * d.cp * d.dp)
    rs = ag = replica = 0.0
    # (parameters, shard degree, replica degree) of the non-expert and the expert states.
    for params, shard, rep in (
        (_local_params(shape, layout) - experts, d.dp_shard * d.cp, d.dp_replicate),
        (experts / d.ep, d.dp_shard // d.ep, d.dp_replicate * d.cp),
    ):
        if params:
            rs += reduce_scatter_s(params * g_bytes, shard, *shard_link)
            ag += all_gather_s(params * p_bytes, shard, *shard_link)
            replica += all_reduce_s(params * g_bytes / shard, rep, *rep_link)
    return rs, ag, replica


def ring_attention_s(
    shape: ModelShape, layout: Layout, topology: Topology, *, seq_len: int, precision: str
) -> float:
    """Seconds of the cp ring's K/V traffic per step on the busiest rank, before overlap: per
    layer and micro-batch, cp - 1 hops of a rank's K and V in forward, and of K, V, dK and dV
    in backward (once more in forward under activation checkpointing)."""
    d = layout.dims
    if d.cp <= 1:
        return 0.0
    kv = 2.0 * seq_len / d.cp * layout.micro_batch * shape.n_kv_heads * shape.head_dim / d.tp
    chunk = kv * STATE_BYTES[precision][0]
    passes = 4 if layout.activation_checkpointing else 3
    bw, lat = _link(topology, d.cp * d.tp)
    layers = busiest_rank(shape, d.pp, layout.virtual_stages, layout.pp_layers)[0]
    return passes * (d.cp - 1) * (lat + chunk / bw) * layers * layout.grad_accum


def expert_all_to_all_s(
    shape: ModelShape, layout: Layout, topology: Topology, *, seq_len: int, precision: str
) -> float:
    """Seconds of the MoE dispatch/combine all-to-alls per step on the busiest rank: 2 per MoE
    block in forward and 2 in backward (3 + 3 under activation checkpointing), each moving the
    rank's tokens x experts_per_token x dim activations, (ep - 1)/ep of them off the rank."""
    d = layout.dims
    if d.ep <= 1 or not shape.is_moe:
        return 0.0
    tokens = seq_len / d.cp * layout.micro_batch
    msg = tokens * shape.experts_per_token * shape.dim * STATE_BYTES[precision][0]
    bw, lat = _link(topology, d.ep * d.cp * d.tp)  # ep dp_shard neighbours, cp x tp apart
    one = (d.ep - 1) / d.ep * msg / bw + (d.ep - 1) * lat
    per_block = 6 if layout.activation_checkpointing else 4
    layers = busiest_rank(shape, d.pp, layout.virtual_stages, layout.pp_layers)[0]
    return per_block * one * layers * layout.grad_accum


def attention_share(shape: ModelShape, seq_len: int) -> float:
    """The share of a step's FLOPs spent in attention's score and value matmuls."""
    return 12.0 * shape.n_layers * shape.dim * seq_len / shape.flops_per_token(seq_len)


def compute_s(
    shape: ModelShape,
    rows_per_rank: int,
    model_parallel: float,
    topology: Topology,
    *,
    seq_len: int,
    mfu: float | None = None,
    recompute: float = 1.0,
    tp: int = 1,
) -> float:
    """Seconds of compute for `rows_per_rank` sequences per DP replica split over `model_parallel`
    ranks (tp x pp for a perfect pipeline split, tp / the busiest stage's share otherwise): the
    part of a step no layout choice hides, so a floor on its total.
    `mfu` None: the calibrated efficiency of `tp`-wide GEMMs (narrower ones are slower, so
    tp=1 gives a floor for every tp)."""
    flops = shape.flops_per_token(seq_len) * (rows_per_rank * seq_len) / model_parallel
    return flops * recompute / (topology.peak_flops * efficiency(shape, tp, topology, mfu))


def efficiency(shape: ModelShape, tp: int, topology: Topology, mfu: float | None) -> float:
    """Fraction of peak the compute reaches: `mfu` if given, else calibrated (`calibration.py`)."""
    if mfu is not None:
        return mfu
    gemm = accelerator_for_peak(topology.peak_flops).gemm_efficiency
    return compute_efficiency(shape.dim, tp, gemm)


def estimate_step_time(
    shape: ModelShape,
    layout: Layout,
    topology: Topology,
    *,
    seq_len: int,
    precision: str = "bf16",
    mfu: float | None = None,
) -> StepTime:
    """Estimated seconds per optimizer step for `layout` on `topology`; `mfu` None: the
    calibrated compute efficiency, else that fixed fraction of peak."""
    if mfu is not None and not 0.0 < mfu <= 1.0:
        raise ValueError(f"mfu must be in (0, 1], got {mfu}")
    d = layout.dims
    act_bytes = STATE_BYTES[precision][0]
    m = layout.grad_accum
    # Full checkpointing re-runs the forward: 1 + 2 passes become 2 + 2.
    recompute = RECOMPUTE_FACTOR if layout.activation_checkpointing else 1.0
    split = (shape, d.pp, layout.virtual_stages, layout.pp_layers)
    # Every batch slot is computed, padding included (`Layout.padded_slots`); the busiest
    # pipeline rank sets the pace (1/pp of the model for a perfect split).
    compute = compute_s(
        shape,
        layout.micro_batch * m,
        d.tp * d.cp / busiest_rank_share(*split),
        topology,
        seq_len=seq_len,
        mfu=mfu,
        recompute=recompute,
        tp=d.tp,
    )

    layers = busiest_rank(*split)[0]
    tp = 0.0
    if d.tp > 1:
        # Megatron: 2 all-reduces forward + 2 backward per layer (SP swaps each for a
        # reduce-scatter/all-gather pair of equal volume); recompute repeats the forward two.
        msg = float(seq_len) / d.cp * layout.micro_batch * shape.dim * act_bytes
        per_layer = (6 if layout.activation_checkpointing else 4) * all_reduce_s(
            msg, d.tp, *_intra(topology)
        )
        tp = per_layer * layers * m

    pp = bubble = 0.0
    if d.pp > 1:
        # One activation forward and one gradient backward per micro-batch at each boundary,
        # split over the TP ranks (scatter-gather); interleaving crosses v times as many.
        msg = float(seq_len) / d.cp * layout.micro_batch * shape.dim * act_bytes / d.tp
        # The slowest boundary sets the pace: NVLink only if the whole pipeline is on one node.
        bw, lat = _link(topology, d.world_size)
        v = layout.virtual_stages
        pp = 2 * m * v * (lat + msg / bw)
        # Bubble fraction (p-1)/(m+p-1) of the pipelined time, i.e. (p-1)/m of the busy time;
        # interleaved schedules shrink it by the number of virtual stages.
        bubble = (compute + tp) * (d.pp - 1) / (v * m)

    kw = {"seq_len": seq_len, "precision": precision}
    ring = ring_attention_s(shape, layout, topology, **kw)
    cp_hidden = min(ring, attention_share(shape, seq_len) * compute)
    cp = ring - cp_hidden + OVERLAP_TAX * cp_hidden
    ep = expert_all_to_all_s(shape, layout, topology, **kw)

    dp_total, window = dp_comm_s(shape, layout, topology, precision)
    # The window never hides the param all-gather after the optimizer step (zero 1/2).
    hideable = (
        dp_total
        if layout.zero_stage in (0, 3)
        else dp_total - _param_gather_s(shape, layout, topology, precision)
    )
    hidden = min(hideable, window * compute)
    dp = dp_total - hidden + OVERLAP_TAX * hidden

    offload = 0.0
    if layout.offload_optimizer:
        # Each step ships the gradient shard to the host, runs CPU Adam, ships params back.
        shard = _local_params(shape, layout) / (d.dp_shard if layout.zero_stage >= 1 else 1)
        p_bytes, g_bytes, _ = STATE_BYTES[precision]
        offload = shard * (p_bytes + g_bytes) / PCIE_BANDWIDTH + shard / CPU_ADAM_PARAMS_PER_S

    total = compute + dp + tp + cp + ep + pp + bubble + offload
    return StepTime(compute, dp, tp, pp, bubble, total, offload, hidden, cp, ep, cp_hidden)


def _param_gather_s(shape: ModelShape, layout: Layout, topology: Topology, precision: str) -> float:
    return _dp_collectives(shape, layout, topology, precision)[1]


def _local_params(shape: ModelShape, layout: Layout) -> float:
    """Parameters of the heaviest pipeline rank's TP shard."""
    d = layout.dims
    return stage_params(shape, d.pp, layout.virtual_stages, layout.pp_layers) / d.tp


def _local_expert_params(shape: ModelShape, layout: Layout) -> float:
    """The routed experts among `_local_params` (before the EP split)."""
    d = layout.dims
    return stage_expert_params(shape, d.pp, layout.virtual_stages, layout.pp_layers) / d.tp
