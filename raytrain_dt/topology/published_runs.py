"""Published measurements of dense decoder training on A100 and H100 clusters, and the step-time
model's prediction of each: the reference `calibration.py` is fitted to and checked against.

Each `PublishedRun` is one row of a paper's or project's table, with the exact configuration it
states; what the source leaves out is an `assumed` note, and `ref` says where the figure was
read (URL, table, row; `SOURCES_CHECKED` how). The published figure is turned into
seconds per step with the source's own formula, and the prediction into the source's unit, so
the ratio is throughput predicted / published (1.0 = exact). bench/bench_planner.py renders the
table, tests/unit/test_calibration.py holds every row within `TOLERANCE`.
"""

from __future__ import annotations

from dataclasses import dataclass

from raytrain_dt.models.presets import PRESETS, ModelShape
from raytrain_dt.topology.calibration import (
    A100_80GB,
    H100_HBM2E_500W,
    H100_SXM,
    AcceleratorSpec,
)
from raytrain_dt.topology.cost import StepTime, estimate_step_time
from raytrain_dt.topology.layout import Layout, Topology
from raytrain_dt.topology.memory import GB, estimate_memory
from raytrain_dt.topology.parallel_dims import ParallelDims
from raytrain_dt.topology.plan_reasons import versus
from raytrain_dt.topology.plan_result import Candidate, Plan
from raytrain_dt.topology.planner import plan

TOLERANCE = 0.20  # predicted throughput within +-20% of the published figure
# The planner's free pick for a published job is predicted no slower than the published layout,
# or within this fraction of it.
FREE_PICK_SLACK = 0.05

MEGATRON = "Narayanan et al. 2021 (Megatron-LM PTD-P), Table 1"
MEGASCALE = "Jiang et al. 2024 (MegaScale), Table 2, Megatron-LM baseline"
TITAN_A100 = "torchtitan docs/performance.md (2024), Llama 3 / Llama 2 on 64 A100"
TITAN_H100 = "torchtitan docs/performance.md (2024-12), Tables 1 and 3"
LLAMA3 = "Dubey et al. 2024 (The Llama 3 Herd of Models), Table 4"


# Where each source's figures were read back, and how (the URLs are also in each row's `ref`).
MEGATRON_README = (
    "https://github.com/NVIDIA/Megatron-LM/blob/50a4b5fa0280a160cc1b03a1c15faddbc1b1da9a/"
    "images/cases_april2021.png"
)
TITAN_A100_DOC = (
    "https://github.com/pytorch/torchtitan/blob/3faaa1a0dee68ce028400e3dafd1735d152cb4f8/"
    "docs/performance.md"
)
TITAN_H100_DOC = (
    "https://github.com/pytorch/torchtitan/blob/d4c86e3758a84cf23e2e879ab3c995cba9d5e410/"
    "docs/performance.md"
)
LLAMA3_PAPER = "https://arxiv.org/abs/2407.21783"
MEGASCALE_PAPER = "https://arxiv.org/abs/2402.15627"

# For the table's "Sources checked" list: source -> (where it was read, what matched and what
# the text leaves out).
SOURCES_CHECKED: dict[str, tuple[str, str]] = {
    MEGATRON: (
        f"{MEGATRON_README} (the README of 2021-04-08 shows the paper's Table 1 as this image, "
        "read here); heads and the tp x pp split from a public reading note's text "
        "transcription of arXiv 2104.04473 Table 1 (found by text search; the index does not "
        "name its repository)",
        "all 10 rows: hidden, layers, parameters, model-parallel size (= tp x pp), GPUs, batch, "
        "TFLOP/s per GPU (137-163), % of peak and aggregate PFLOP/s match the image; heads and "
        "tp/pp from the transcription agree with its model-parallel sizes; vocabulary 51,200 "
        "and sequence 2048 from the same README's text. Micro-batch and schedule not stated",
    ),
    TITAN_A100: (
        f"{TITAN_A100_DOC} (the 64 x A100 80GB tables, on main from 2024-04-24 until Llama 2 "
        "was dropped on 2024-12-03); sequence lengths from train_configs/llama3_8b.toml and "
        "llama3_70b.toml (8192), llama2_13b.toml and llama2_70b.toml (4096) at that commit",
        "local batch, AC mode and WPS of the 4 rows (2904, 331, 2162, 353) match; global batch "
        "= local x 64 as the page states",
    ),
    TITAN_H100: (
        f"{TITAN_H100_DOC} (2025-01-30; runs of 2024-12, later moved to "
        "benchmarks/llama3_h100_202412_torchtitan.md); sequence 8192 from "
        "train_configs/llama3_8b.toml at the same commit",
        "Tables 1 and 3, FSDP eager rows (no torch.compile, no Float8): local batch 2, global "
        "16 and 256, selective AC, 5,762 and 5,605 TPS/GPU; H100 96 GB HBM2e at 500 W",
    ),
    LLAMA3: (
        f"{LLAMA3_PAPER} §3.3.2 and Table 4 (p. 10), read in full-text copies of the arXiv "
        "HTML and PDF stored in public repositories (found by text search); GPUs, TP, CP, PP, "
        "tokens per batch and TFLOP/s also on an SC'24 slide quoted at "
        "https://glennklockwood.com/garden/llama-3.1",
        "8,192 and 16,384 GPUs, TP 8, CP 1, PP 16, DP 64/128, sequence 8192, batch/DP 32/16 "
        "(2,048 sequences, 16M tokens), 430/400 TFLOP/s per GPU (43%/41% BF16 MFU); FSDP "
        "sharding gradients and optimizer states without resharding parameters after forward, "
        "interleaved schedule, first/last stage one layer short, no activation checkpointing. "
        "The third row (TP 8, CP 16, PP 16, DP 8, 131,072 tokens, batch/DP 16, 16M tokens, "
        "380 TFLOP/s, 38%) is the long-context stage",
    ),
    MEGASCALE: (
        f"{MEGASCALE_PAPER} Tables 1-2 as transcribed, with iteration times and throughputs, "
        "in a public reading note (found by text search; the index does not name its "
        "repository); the 12,288-GPU row (tp 8, pp 8, dp 192, batch 6144) also in "
        "https://github.com/JaneLiCC/Notes/blob/0945a178a981f376b8d597de5cce6fb6a6ecb2a9/eos.md, "
        "sequence 2048 and vocabulary 64K in https://github.com/JaneLiCC/Notes/blob/"
        "2dcd408c3265b29272ad9778a5aab967550f6c6f/megaScale.md",
        "175B: 96 layers, hidden 12288, 128 heads, TP 8, PP 8; batch 768 on 256-1,024 GPUs, "
        "6,144 on 3,072-12,288; Megatron-LM MFU 53.0, 49.9, 46.7, 44.7, 48.7, 47.8, 43.3, "
        "41.2%, and 55.2/1.34 = 41.2 from the abstract; iteration times 40.0-8.57 s agree "
        "with MFU x 312 TFLOP/s",
    ),
}


@dataclass(frozen=True)
class PublishedRun:
    source: str
    label: str
    shape: ModelShape
    gpu: AcceleratorSpec
    gpus: int
    tp: int
    pp: int
    global_batch: int  # sequences per step
    seq_len: int
    micro_batch: int
    zero_stage: int  # 0: replicated (Megatron 2021), 3: FSDP
    activation_checkpointing: bool
    figure: float  # as published, in `unit`
    unit: str  # "TFLOP/s/GPU (hw)", "TFLOP/s/GPU (model)", "% MFU (model)" or "tokens/s/GPU"
    virtual_stages: int = 1
    cp: int = 1  # context-parallel degree (ranks sharing each sequence)
    # Gradients accumulate (fp32) over the micro-batches and are reduce-scattered once per step.
    defer_grad_sync: bool = False
    assumed: str = ""  # configuration the source does not state
    ref: str = ""  # where the figure was read: URL, table and row

    def layout(self) -> Layout:
        dp = self.gpus // (self.tp * self.pp * self.cp)
        shard = dp if self.zero_stage else 1
        dims = ParallelDims(
            world_size=self.gpus,
            pp=self.pp,
            dp_replicate=dp // shard,
            dp_shard=shard,
            cp=self.cp,
            tp=self.tp,
        )
        return Layout(
            dims,
            self.zero_stage,
            self.micro_batch,
            self.global_batch // (dp * self.micro_batch),
            activation_checkpointing=self.activation_checkpointing,
            sequence_parallel=self.tp > 1 and self.source != MEGATRON,
            pp_schedule="interleaved" if self.virtual_stages > 1 else "1f1b",
            virtual_stages=self.virtual_stages,
            defer_grad_sync=self.defer_grad_sync,
        )

    def topology(self) -> Topology:
        g = self.gpu
        return Topology(
            num_nodes=max(1, self.gpus // 8),
            accelerators_per_node=min(8, self.gpus),
            memory_per_accelerator=g.memory,
            peak_flops=g.peak_flops,
            intra_node_bandwidth=g.intra_node_bandwidth,
            inter_node_bandwidth=g.inter_node_bandwidth,
        )

    def published_step_s(self) -> float:
        """Seconds per step the published figure implies, by the source's own FLOP count."""
        tokens = self.global_batch * self.seq_len
        if self.unit == "tokens/s/GPU":
            return tokens / (self.figure * self.gpus)
        if self.unit == "% MFU (model)":
            return self.step_flops() / (self.figure / 100 * self.gpu.peak_flops * self.gpus)
        return self.step_flops() / (self.figure * 1e12 * self.gpus)

    def step_flops(self) -> float:
        s, b = self.shape, self.global_batch
        if self.unit == "TFLOP/s/GPU (hw)":
            # Megatron's count, recomputation included: 96 B s l h^2 (1 + s/6h + V/16lh).
            h, n, seq = s.dim, s.n_layers, self.seq_len
            return 96.0 * b * seq * n * h * h * (1 + seq / (6 * h) + s.vocab_size / (16 * n * h))
        return s.flops_per_token(self.seq_len) * b * self.seq_len

    def predicted(self) -> StepTime:
        return estimate_step_time(
            self.shape, self.layout(), self.topology(), seq_len=self.seq_len, precision="bf16"
        )

    def predicted_figure(self) -> float:
        """The prediction in the published unit."""
        return self.figure * self.published_step_s() / self.predicted().total_s

    def ratio(self) -> float:
        return self.predicted_figure() / self.figure

    def published_candidate(self) -> Candidate:
        """The published layout as the planner prices it (whether or not it fits)."""
        lay = self.layout()
        mem = estimate_memory(self.shape, lay, seq_len=self.seq_len, precision="bf16")
        return Candidate(lay, mem, self.predicted())

    def free_plan(self) -> Plan:
        """The planner's own pick for the same job: model, GPUs, batch and sequence."""
        return plan(
            self.shape, self.topology(), global_batch=self.global_batch, seq_len=self.seq_len
        )

    def free_vs_published(self) -> tuple[float, str]:
        """(free pick's step time / the published layout's, why they differ)."""
        free, published = self.free_plan().best, self.published_candidate()
        why = versus(free, published, self.topology().memory_per_accelerator / GB)
        return free.step_time.total_s / published.step_time.total_s, why


def _gpt(dim: int, layers: int, heads: int, vocab: int = 51200) -> ModelShape:
    """Megatron's GPT: vocabulary 51,200 (the README's), 4h MLP of two matrices (as 8h/3 of our
    three)."""
    return ModelShape(dim, layers, heads, heads, vocab, round(8 * dim / 3))


LLAMA3_8B = ModelShape(4096, 32, 32, 8, 128256, 14336, rope_theta=500000.0)
LLAMA2_70B = ModelShape(8192, 80, 64, 8, 32000, 28672)

_MEGATRON_ASSUMED = "micro-batch 1 and the 1F1B schedule (not in Table 1)"
_LLAMA3_ASSUMED = (
    "micro-batch 1 and 4 virtual stages (not in Table 4; §3.3.2's first chunk holding only the "
    "embedding suggests 8 one-block chunks per rank, which a split giving every chunk a block "
    "cannot express for 126 blocks); FSDP sharding gradients and optimizer "
    "states but not resharding parameters after forward, no recomputation (as §3.3.2 says). "
    "The memory model puts this layout over 80 GB, its activations alone over what the budget "
    "leaves them (the free-pick row gives the figures): the interleaved schedule's warm-up keeps "
    "77 two-block chunks in flight on pp rank 1 with 32 micro-batches (3 x 16 + 2 x 14 + 1), "
    "and all 64 chunk forwards before the first backward with 16 (one round, as Megatron-LM and "
    "torch run it). The stage outputs the paper deallocates are not priced (the per-layer count "
    "holds none); how the paper fits the rest is not stated"
)
_LLAMA3_LONG_ASSUMED = (
    "as the 8K rows: micro-batch 1, 4 virtual stages, no recomputation (not in Table 4). "
    "Llama 3's CP all-gathers each layer's K/V instead of passing them round a ring: the same "
    "(cp - 1)/cp of the sequence's K/V per rank, priced as the ring, behind the attention. "
    "Attention FLOPs counted in full (12 x layers x dim x seq per token, as every row), not "
    "halved for the causal mask"
)
_TITAN_H100_ASSUMED = (
    "sequence 8192 (the llama3_8b.toml default; the table does not state it); selective AC "
    "priced as none"
)
_MEGASCALE_ASSUMED = (
    "micro-batch 1, 1F1B without interleaving, Megatron's distributed optimizer priced as "
    "ZeRO-1, selective (no full) recomputation (not in the paper's Tables 1-2). Sequence 2048 "
    "from Table 2's throughput x iteration time / batch; vocabulary 64K from a reading note "
    "(51,200 would change the FLOP count by 0.1%). The same note reads the runs as interleaved "
    "with 6 virtual stages, which the tables do not show; priced that way the rows read "
    "0.91-1.09 instead of 0.90-0.97"
)


def _megatron(label, dim, layers, heads, tp, pp, gpus, batch, tflops) -> PublishedRun:
    size = label.removeprefix("GPT ")
    return PublishedRun(
        MEGATRON,
        label,
        _gpt(dim, layers, heads),
        A100_80GB,
        gpus,
        tp,
        pp,
        batch,
        2048,
        1,
        0,
        True,
        tflops,
        "TFLOP/s/GPU (hw)",
        assumed=_MEGATRON_ASSUMED,
        ref=f"{MEGATRON_README}, row {size} (arXiv 2104.04473 Table 1)",
    )


def _megascale(gpus: int, batch: int, mfu: float) -> PublishedRun:
    return PublishedRun(
        MEGASCALE,
        f"GPT 175B, {gpus:,} GPUs, batch {batch}",
        _gpt(12288, 96, 128, vocab=64000),
        A100_80GB,
        gpus,
        8,
        8,
        batch,
        2048,
        1,
        1,
        False,
        mfu,
        "% MFU (model)",
        assumed=_MEGASCALE_ASSUMED,
        ref=f"{MEGASCALE_PAPER} Table 2, Megatron-LM, batch {batch}, {gpus:,} GPUs",
    )


PUBLISHED_RUNS: list[PublishedRun] = [
    # GPT models on Selene (A100 80GB), sequence 2048, full recomputation, mixed precision.
    _megatron("GPT 1.7B", 2304, 24, 24, 1, 1, 32, 512, 137),
    _megatron("GPT 3.6B", 3072, 30, 32, 2, 1, 64, 512, 138),
    _megatron("GPT 7.5B", 4096, 36, 32, 4, 1, 128, 512, 142),
    _megatron("GPT 18.4B", 6144, 40, 48, 8, 1, 256, 1024, 135),
    _megatron("GPT 39.1B", 8192, 48, 64, 8, 2, 512, 1536, 138),
    _megatron("GPT 76.1B", 10240, 60, 80, 8, 4, 1024, 1792, 140),
    _megatron("GPT 145.6B", 12288, 80, 96, 8, 8, 1536, 2304, 148),
    _megatron("GPT 310.1B", 16384, 96, 128, 8, 16, 1920, 2160, 155),
    _megatron("GPT 529.6B", 20480, 105, 128, 8, 35, 2520, 2520, 163),
    _megatron("GPT 1008B", 25600, 128, 160, 8, 64, 3072, 3072, 163),
    # FSDP2 (1D) on 64 A100 80GB, bf16, local batch as listed; MFU against 312 TFLOP/s.
    PublishedRun(
        TITAN_A100,
        "Llama 3 8B, FSDP 64, selective layer AC",
        LLAMA3_8B,
        A100_80GB,
        64,
        1,
        1,
        64,
        8192,
        1,
        3,
        False,
        2904,
        "tokens/s/GPU",
        assumed="selective AC priced as none",
        ref=f"{TITAN_A100_DOC}, Llama 3 table, 8B / batch 1 / selective layer",
    ),
    PublishedRun(
        TITAN_A100,
        "Llama 3 70B, FSDP 64, full AC",
        PRESETS["llama-70b"],
        A100_80GB,
        64,
        1,
        1,
        64,
        8192,
        1,
        3,
        True,
        331,
        "tokens/s/GPU",
        ref=f"{TITAN_A100_DOC}, Llama 3 table, 70B / batch 1 / full",
    ),
    PublishedRun(
        TITAN_A100,
        "Llama 2 13B, FSDP 64, no AC",
        PRESETS["llama-13b"],
        A100_80GB,
        64,
        1,
        1,
        128,
        4096,
        2,
        3,
        False,
        2162,
        "tokens/s/GPU",
        ref=f"{TITAN_A100_DOC}, Llama 2 table, 13B / batch 2 / no",
    ),
    PublishedRun(
        TITAN_A100,
        "Llama 2 70B, FSDP 64, full AC",
        LLAMA2_70B,
        A100_80GB,
        64,
        1,
        1,
        128,
        4096,
        2,
        3,
        True,
        353,
        "tokens/s/GPU",
        ref=f"{TITAN_A100_DOC}, Llama 2 table, 70B / batch 2 / full",
    ),
    # FSDP2 (1D), eager bf16 (no torch.compile, no Float8), local batch 2, selective AC.
    PublishedRun(
        TITAN_H100,
        "Llama 3.1 8B, FSDP 8",
        LLAMA3_8B,
        H100_HBM2E_500W,
        8,
        1,
        1,
        16,
        8192,
        2,
        3,
        False,
        5762,
        "tokens/s/GPU",
        assumed=_TITAN_H100_ASSUMED,
        ref=f"{TITAN_H100_DOC}, Table 1, row FSDP",
    ),
    PublishedRun(
        TITAN_H100,
        "Llama 3.1 8B, FSDP 128",
        LLAMA3_8B,
        H100_HBM2E_500W,
        128,
        1,
        1,
        256,
        8192,
        2,
        3,
        False,
        5605,
        "tokens/s/GPU",
        assumed=_TITAN_H100_ASSUMED,
        ref=f"{TITAN_H100_DOC}, Table 3, row FSDP",
    ),
    # Llama 3 405B pre-training, H100 SXM 80GB, tp=8 pp=16 (uneven first/last stages), 16M
    # tokens per step, bf16; TFLOP/s per GPU as published (43% and 41% BF16 MFU).
    PublishedRun(
        LLAMA3,
        "Llama 3 405B, 8,192 GPUs, dp=64",
        PRESETS["llama-405b"],
        H100_SXM,
        8192,
        8,
        16,
        2048,
        8192,
        1,
        2,
        False,
        430,
        "TFLOP/s/GPU (model)",
        virtual_stages=4,
        defer_grad_sync=True,
        assumed=_LLAMA3_ASSUMED,
        ref=f"{LLAMA3_PAPER} Table 4, row 1 (8,192 GPUs)",
    ),
    PublishedRun(
        LLAMA3,
        "Llama 3 405B, 16,384 GPUs, dp=128",
        PRESETS["llama-405b"],
        H100_SXM,
        16384,
        8,
        16,
        2048,
        8192,
        1,
        2,
        False,
        400,
        "TFLOP/s/GPU (model)",
        virtual_stages=4,
        defer_grad_sync=True,
        assumed=_LLAMA3_ASSUMED,
        ref=f"{LLAMA3_PAPER} Table 4, row 2 (16,384 GPUs, DP 128)",
    ),
    # The long-context stage: 131,072 tokens, the same 16M tokens per step, CP 16.
    PublishedRun(
        LLAMA3,
        "Llama 3 405B, 16,384 GPUs, 131K tokens, cp=16",
        PRESETS["llama-405b"],
        H100_SXM,
        16384,
        8,
        16,
        128,
        131072,
        1,
        2,
        False,
        380,
        "TFLOP/s/GPU (model)",
        virtual_stages=4,
        cp=16,
        defer_grad_sync=True,
        assumed=_LLAMA3_LONG_ASSUMED,
        ref=f"{LLAMA3_PAPER} Table 4, row 3 (16,384 GPUs, CP 16, sequence 131,072)",
    ),
    # GPT-3 175B (Table 1: 96 layers, hidden 12288, 128 heads, tp=8 pp=8) on A100 GPUs, 8 x 200
    # Gb/s NICs per node; the Megatron-LM baseline's MFU at a fixed batch (strong scaling).
    *(
        _megascale(gpus, batch, mfu)
        for batch, gpus, mfu in [
            (768, 256, 53.0),
            (768, 512, 49.9),
            (768, 768, 46.7),
            (768, 1024, 44.7),
            (6144, 3072, 48.7),
            (6144, 6144, 47.8),
            (6144, 8192, 43.3),
            (6144, 12288, 41.2),
        ]
    ),
]
