"""The step-time model's calibrated constants, each beside the measurement it comes from.

One place for every number `cost.py` takes from the outside world: accelerator peaks and
links, the fraction of peak a training step's GEMMs reach by their size, the fraction of a
link NCCL's ring collectives reach, and the cost of activation recomputation. The published
runs they are checked against (and fitted to, where a source gives no direct figure) are in
`published_runs.py`; bench/bench_planner.py prints the comparison, tests/unit hold it.
Pure data and arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

# Named in `plan --json` and the simulator's report: which calibration produced the figures.
CALIBRATION = "published-runs-v1 (Megatron-LM PTD-P 2021, torchtitan 2024, Llama 3 2024)"


@dataclass(frozen=True)
class AcceleratorSpec:
    """A GPU kind as the step-time model sees it. Bandwidths per GPU and direction, bytes/s."""

    name: str
    peak_flops: float  # dense bf16 tensor-core peak
    memory: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    # Fraction of `peak_flops` a transformer layer's GEMMs reach when they are wide (the limit
    # of `compute_efficiency` as dim/tp grows): kernel efficiency plus the non-GEMM work
    # (norms, softmax, rotary, optimizer) a FLOP count leaves out.
    gemm_efficiency: float


# NVIDIA A100 SXM4 80GB datasheet: 312 TFLOP/s dense bf16, NVLink3 600 GB/s bidirectional.
# Inter-node: Selene (Megatron-LM's runs), 8 HDR 200 Gb/s InfiniBand NICs per 8-GPU node.
# gemm_efficiency: fitted to the Megatron-LM rows of `published_runs.py` (Narayanan et al.
# 2021, Table 1: 44-52% of peak end to end with full recomputation).
A100_80GB = AcceleratorSpec("a100-80gb", 312e12, 80e9, 300e9, 25e9, gemm_efficiency=0.64)
# NVIDIA H100 SXM5 80GB datasheet: 989 TFLOP/s dense bf16, NVLink4 900 GB/s bidirectional;
# one 400 Gb/s NDR NIC per GPU (DGX H100, Llama 3's and torchtitan's clusters alike).
# gemm_efficiency: fitted to the Llama 3 405B and torchtitan H100 rows; H100 reaches a
# smaller fraction of its (3.2x larger) peak than A100 at the same memory-bound overheads.
H100_SXM = AcceleratorSpec("h100-sxm", 989e12, 80e9, 450e9, 50e9, gemm_efficiency=0.60)
# torchtitan's benchmark GPUs (docs/performance.md, Grand Teton): H100 with 96 GB HBM2e at a
# 500 W power limit, "peak between SXM and NVL" (989 and 835 TFLOP/s): the midpoint. At 500 W
# sustained GEMMs throttle the clock: gemm_efficiency fitted to torchtitan's two H100 rows
# (its only source; they report 33-39% MFU where Llama 3's 700 W GPUs reach 41-43%).
H100_HBM2E_500W = AcceleratorSpec(
    "h100-hbm2e-500w", 912e12, 96e9, 450e9, 50e9, gemm_efficiency=0.40
)
ACCELERATORS = {a.name: a for a in (A100_80GB, H100_SXM, H100_HBM2E_500W)}

# GEMM efficiency falls as tensor parallelism narrows the matrices: Narayanan et al. 2021
# (Fig. 13/§5.4: smaller per-GPU GEMMs as t grows) and the Table 1 trend (137 TFLOP/s at
# h=2304 rising to 163 at h=25600/8). Modelled as width / (width + GEMM_HALF_WIDTH) with
# width = dim / tp, the half-efficiency width fitted to those rows.
GEMM_HALF_WIDTH = 256.0

# Fraction of the link bandwidth a large ring all-reduce/reduce-scatter/all-gather reaches
# (NCCL's "bus bandwidth"): nccl-tests on DGX A100/H100 report ~230/~360 GB/s of 300/450 GB/s
# NVLink and ~85-90% of line rate on InfiniBand.
INTRA_NODE_BUS_EFFICIENCY = 0.8
INTER_NODE_BUS_EFFICIENCY = 0.85

# Full activation recomputation re-runs each layer's forward: 3 passes become 4
# (Korthikanti et al. 2022, §5: full recomputation costs 30-40% more time; Narayanan et al.
# 2021 count it as 96 B s l h^2 FLOPs instead of 72).
RECOMPUTE_FACTOR = 4.0 / 3.0

# Pipeline bubble: (p - 1) / (v m) of the busy time for 1F1B with v virtual stages per rank
# and m micro-batches (Narayanan et al. 2021, §2.2, eq. for the interleaved schedule); the
# formula itself lives in `cost.py`, it has no fitted constant.


def compute_efficiency(dim: int, tp: int, gemm_efficiency: float) -> float:
    """Fraction of peak FLOP/s a layer reaches with `dim / tp` wide GEMMs on each rank."""
    width = dim / max(1, tp)
    return gemm_efficiency * width / (width + GEMM_HALF_WIDTH)


def accelerator_for_peak(peak_flops: float) -> AcceleratorSpec:
    """The calibrated kind whose peak is nearest `peak_flops` (a topology only knows its peak):
    what `gemm_efficiency` a cluster of unnamed GPUs gets."""
    return min(ACCELERATORS.values(), key=lambda a: abs(a.peak_flops - peak_flops))
