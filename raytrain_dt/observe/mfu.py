"""Model FLOPs utilization: the peak FLOP/s of an accelerator and the MFU of a step.

MFU = model FLOPs per token (`ModelShape.flops_per_token`: 6 x matmul parameters plus the
attention score/value matmuls, no recompute) x tokens per second / (world size x peak FLOP/s).
The peak is `cluster.peak_tflops` when set, else looked up by the device name torch reports.
Pure arithmetic: the rank computes it where it measures the step time.
"""

from __future__ import annotations

from raytrain_dt.topology.layout import CPU_PEAK_FLOPS, Topology

# Dense bf16 tensor-core TFLOP/s (no sparsity) by a fragment of torch.cuda.get_device_name().
# Checked in order, so "H100 PCIe" comes before "H100".
GPU_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("MI300X", 1307.0),
    ("V100", 125.0),  # fp16: V100 has no bf16
    ("T4", 65.0),  # fp16
)


def peak_flops_per_accelerator(device_name: str, configured_tflops: float | None) -> float:
    """Peak FLOP/s of one accelerator: the configured value, else by name; `device_name` is
    "cpu" for CPU ranks. Unknown GPUs count as the planner's default (an H100)."""
    if configured_tflops:
        return configured_tflops * 1e12
    # The emulated accelerator (`accel/emulated/`) computes with the host's CPU kernels.
    if device_name == "cpu" or "emulated" in device_name.lower():
        return CPU_PEAK_FLOPS
    for fragment, tflops in GPU_PEAK_TFLOPS:
        if fragment.lower() in device_name.lower():
            return tflops * 1e12
    return Topology(num_nodes=1, accelerators_per_node=1).peak_flops


def mfu(
    model_flops_per_token: float, tokens_per_s: float, world_size: int, peak_flops: float
) -> float:
    """Fraction of the group's peak FLOP/s that the model's own arithmetic used."""
    return model_flops_per_token * tokens_per_s / (world_size * peak_flops)
