"""`raytrain-dt plan`: ask the planner for a layout without starting anything.

Builds a `ModelShape` (a preset, or a Llama-like shape for `--params`, a mixture of experts
with `--experts`/`--active-experts`) and a `Topology` from flags, runs `planner.plan`, and prints either a readable report or one JSON object. Errors
the user can fix (bad flags, pins, nothing fits) print one line to stderr and return 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from raytrain_dt.errors import UserError
from raytrain_dt.models.presets import PRESETS, ModelShape
from raytrain_dt.topology.calibration import ACCELERATORS, CALIBRATION, H100_SXM
from raytrain_dt.topology.cost import HIDDEN_KEYS
from raytrain_dt.topology.layout import Topology
from raytrain_dt.topology.memory import ENGINES, shape_for_params
from raytrain_dt.topology.pins import LayoutPins, engine_pins
from raytrain_dt.topology.pipeline_stages import split_of
from raytrain_dt.topology.plan_reasons import versus
from raytrain_dt.topology.plan_result import Candidate, Plan
from raytrain_dt.topology.planner import plan

# About 4M tokens per step, the budget Llama 2/3 pre-training used, unless --global-batch.
DEFAULT_TOKENS_PER_STEP = 4 * 2**20


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model (one of)")
    model.add_argument("--model", choices=sorted(PRESETS), help="a model preset")
    model.add_argument(
        "--params", type=float, help="a parameter count, e.g. 7.5e9 (Llama-like shape)"
    )
    model.add_argument(
        "--experts",
        type=int,
        default=0,
        help="with --params: a mixture of experts with this many experts per block",
    )
    model.add_argument(
        "--active-experts",
        type=int,
        default=None,
        help="with --experts: experts each token is routed to (top-k; default 2)",
    )
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--nodes", type=int, help="number of nodes")
    cluster.add_argument("--gpus", type=int, help="total accelerators (instead of --nodes)")
    cluster.add_argument(
        "--gpus-per-node", type=int, default=None, help="accelerators per node (8)"
    )
    cluster.add_argument(
        "--gpu",
        choices=sorted(ACCELERATORS),
        default=H100_SXM.name,
        help="accelerator kind: peak, links and memory as calibrated (topology/calibration.py)",
    )
    cluster.add_argument(
        "--gpu-mem-gb", type=float, default=None, help="memory per accelerator, GB (--gpu's)"
    )
    cluster.add_argument(
        "--host-mem-gb",
        type=float,
        default=None,
        help="host memory per node, GB (default: not checked)",
    )
    cluster.add_argument(
        "--peak-tflops", type=float, default=None, help="dense bf16 TFLOP/s each (--gpu's)"
    )
    cluster.add_argument(
        "--intra-gbps", type=float, default=None, help="NVLink GB/s per accelerator (--gpu's)"
    )
    cluster.add_argument(
        "--inter-gbps", type=float, default=None, help="network GB/s per accelerator (--gpu's)"
    )
    train = parser.add_argument_group("training")
    train.add_argument("--seq-len", type=int, default=4096)
    train.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="sequences per optimizer step (default: about 4M tokens)",
    )
    train.add_argument(
        "--batch-tolerance",
        type=float,
        default=0.0,
        help="fraction by which the global batch may drop to fit the ranks better "
        "(trainer.batch_tolerance; default 0: exact)",
    )
    train.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    train.add_argument(
        "--engine",
        choices=ENGINES,
        default="fsdp2",
        help="training engine: what each ZeRO stage holds, and which layouts it can run",
    )
    pins = parser.add_argument_group("pins (default: the planner chooses)")
    pins.add_argument("--tp", type=int)
    pins.add_argument("--pp", type=int)
    pins.add_argument("--cp", type=int, help="context-parallel degree (parallel.cp)")
    pins.add_argument("--ep", type=int, help="expert-parallel degree (parallel.ep)")
    pins.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3))
    pins.add_argument("--micro-batch", type=int)
    knobs = parser.add_argument_group("model knobs")
    knobs.add_argument(
        "--margin", type=float, default=0.10, help="memory margin, fraction of total"
    )
    knobs.add_argument(
        "--mfu",
        type=float,
        default=None,
        help="fixed model FLOPs utilisation (default: calibrated, by GEMM width)",
    )
    knobs.add_argument("--top-k", type=int, default=5, help="alternatives to show")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _inputs(args: argparse.Namespace) -> tuple[str, ModelShape, Topology, int]:
    if (args.model is None) == (args.params is None):
        raise UserError("plan: give exactly one of --model and --params")
    if args.model and (args.experts or args.active_experts is not None):
        raise UserError("--experts/--active-experts: only with --params (a preset has its own)")
    name = args.model or f"{args.params:.3g} params"
    shape = PRESETS[args.model] if args.model else _params_shape(args)
    if (args.nodes is None) == (args.gpus is None):
        raise UserError("plan: give exactly one of --nodes and --gpus")
    per_node = args.gpus_per_node or 8
    if args.gpus is not None:
        if args.gpus < 1:
            raise UserError(f"--gpus: must be >= 1, got {args.gpus}")
        if args.gpus_per_node is None and args.gpus < per_node:
            per_node = args.gpus  # a single partial node
        if args.gpus % per_node:
            raise UserError(
                f"--gpus: {args.gpus} is not a multiple of --gpus-per-node ({per_node})"
            )
        nodes = args.gpus // per_node
    else:
        nodes = args.nodes
    if nodes < 1 or per_node < 1:
        raise UserError(f"--nodes/--gpus-per-node: must be >= 1, got {nodes}, {per_node}")
    if args.host_mem_gb is not None and args.host_mem_gb <= 0:
        raise UserError(f"--host-mem-gb: must be > 0, got {args.host_mem_gb}")
    gpu = ACCELERATORS[args.gpu]

    def given(value: float | None, default: float, unit: float) -> float:
        return default if value is None else value * unit

    topo = Topology(
        num_nodes=nodes,
        accelerators_per_node=per_node,
        memory_per_accelerator=given(args.gpu_mem_gb, gpu.memory, 1e9),
        peak_flops=given(args.peak_tflops, gpu.peak_flops, 1e12),
        intra_node_bandwidth=given(args.intra_gbps, gpu.intra_node_bandwidth, 1e9),
        inter_node_bandwidth=given(args.inter_gbps, gpu.inter_node_bandwidth, 1e9),
        host_memory_per_node=(args.host_mem_gb or 0.0) * 1e9,
    )
    batch = args.global_batch or max(1, round(DEFAULT_TOKENS_PER_STEP / args.seq_len))
    return name, shape, topo, batch


def _params_shape(args: argparse.Namespace) -> ModelShape:
    """The shape `--params` (and `--experts`, `--active-experts`) describe."""
    if args.experts < 0:
        raise UserError(f"--experts: must be >= 0, got {args.experts}")
    if not args.experts:
        if args.active_experts is not None:
            raise UserError("--active-experts: needs --experts")
        return shape_for_params(args.params)
    active = 2 if args.active_experts is None else args.active_experts
    if not 1 <= active <= args.experts:
        raise UserError(f"--active-experts: must be in 1..--experts ({args.experts}), got {active}")
    return shape_for_params(args.params, experts=args.experts, active=active)


def _row(c: Candidate) -> str:
    lay, d, gb = c.layout, c.layout.dims, c.memory.as_gb()
    flags = ("ac " if lay.activation_checkpointing else "") + (
        "off" if lay.offload_optimizer else ""
    )
    return (
        f"{d.tp:>3} {d.pp:>3} {d.cp:>3} {d.ep:>3} {d.dp_replicate:>4}x{d.dp_shard:<5} "
        f"{lay.zero_stage:>4} "
        f"{lay.micro_batch:>3}x{lay.grad_accum:<5} {flags:<6} {gb['total']:>7.1f} "
        f"{c.step_time.total_s:>9.3f}  {c.reason}"
    )


def assumptions(args: argparse.Namespace) -> dict[str, str]:
    """What the figures assume: `plan --json` states it, the report prints it."""
    return {
        "engine": args.engine,
        "precision": args.precision,
        "gpu": args.gpu,
        "compute_efficiency": "calibrated" if args.mfu is None else f"fixed mfu {args.mfu}",
        "calibration": CALIBRATION,
    }


def _stages(shape: ModelShape, layout) -> str:
    """The pipeline split, run-length encoded: "7, 8 x 14, 7"."""
    counts = split_of(shape, layout.dims.pp, layout.virtual_stages, layout.pp_layers)
    runs: list[list[int]] = []
    for c in counts:
        if runs and runs[-1][0] == c:
            runs[-1][1] += 1
        else:
            runs.append([c, 1])
    text = ", ".join(f"{c} x {n}" if n > 1 else str(c) for c, n in runs)
    return text + (f" ({layout.pp_schedule}, v={layout.virtual_stages})")


def format_plan(
    name: str,
    shape: ModelShape,
    topo: Topology,
    p: Plan,
    seq_len: int,
    assumes: dict,
    global_batch: int = 0,
) -> str:
    """The readable report; `global_batch`: the configured batch, named when the layout trains
    a smaller one (a batch tolerance)."""
    b, d = p.best, p.best.layout.dims
    gb, t = b.memory.as_gb(), b.step_time
    moe = (
        f", {shape.n_experts} experts (top-{shape.experts_per_token}), "
        f"{shape.flops_per_token(0) / 6e9:.2f}B active"
        if shape.is_moe
        else ""
    )
    real = b.layout.global_batch
    batch = f"{real} of {global_batch}" if global_batch and real != global_batch else f"{real}"
    lines = [
        f"model   {name}: {shape.num_params / 1e9:.2f}B params, {shape.n_layers} layers, "
        f"dim {shape.dim}{moe}",
        "assumes " + ", ".join(f"{k} {v}" for k, v in assumes.items()),
        f"cluster {topo.num_nodes} node(s) x {topo.accelerators_per_node} accelerators, "
        f"{topo.memory_per_accelerator / 1e9:.0f} GB each; global batch {batch} x "
        f"{seq_len} tokens",
        "",
        f"layout  {b.layout.describe()}  (world {d.world_size})",
        f"        tp={d.tp} pp={d.pp} cp={d.cp} dp={d.dp} (replicate {d.dp_replicate} x shard "
        f"{d.dp_shard}) ep={d.ep} "
        f"zero={b.layout.zero_stage} micro_batch={b.layout.micro_batch} "
        f"grad_accum={b.layout.grad_accum}",
        *([f"        blocks per stage {_stages(shape, b.layout)}"] if d.pp > 1 else []),
        "",
        "memory per rank (GB)",
        *(
            f"  {k:<12}{gb[k]:>9.2f}"
            for k in ("params", "grads", "optimizer", "activations", "margin")
        ),
        f"  {'total':<12}{gb['total']:>9.2f}  of {p.memory_budget_gb:.0f}",
        "  model states at dp="
        + str(d.dp)
        + " (tp=pp=1): "
        + ", ".join(f"{k} {v:.1f}" for k, v in p.model_states_gb.items()),
        f"host memory per node (GB) {b.host_per_node / 1e9:.1f}"
        + (
            f" of {topo.host_memory_per_node / 1e9:.0f}"
            if topo.host_memory_per_node
            else " (not checked: --host-mem-gb)"
        ),
        "",
        f"step time (s)  {t.total_s:.3f}",
        *(
            f"  {k.removesuffix('_s'):<12}{v:>9.3f}"
            for k, v in t.as_dict().items()
            if k not in ("total_s", *HIDDEN_KEYS) and (v or k == "compute_s")
        ),
        f"  (DP traffic overlapped with compute: {t.dp_hidden_s:.3f} s, not in the total)",
        *(
            [f"  (ring K/V traffic behind attention: {t.cp_hidden_s:.3f} s, not in the total)"]
            if d.cp > 1
            else []
        ),
        "",
        f"why     {b.reason}",
    ]
    if p.alternatives:
        lines += [
            "",
            "alternatives",
            " tp  pp  cp  ep  dp(rep x shard) zero  mb x ga    flags  mem GB    step s  why",
        ]
        lines += [" " + _row(c) for c in p.alternatives]
    return "\n".join(lines)


def run_plan(args: argparse.Namespace) -> int:
    try:
        name, shape, topo, batch = _inputs(args)
        pins = LayoutPins(
            tp=args.tp,
            pp=args.pp,
            cp=args.cp,
            ep=args.ep,
            zero_stage=args.zero_stage,
            micro_batch=args.micro_batch,
        )
        kw = {
            "global_batch": batch,
            "seq_len": args.seq_len,
            "precision": args.precision,
            "margin": args.margin,
            "mfu": args.mfu,
            "top_k": args.top_k,
            "engine": args.engine,
            "batch_tolerance": args.batch_tolerance,
        }
        result = plan(shape, topo, pins=engine_pins(args.engine, pins), **kw)
        # With pins, also the free pick, and why it differs from the pinned layout.
        free = None
        if pins != LayoutPins():
            free = plan(shape, topo, pins=engine_pins(args.engine, LayoutPins()), **kw).best
    except (UserError, ValueError) as exc:  # ValueError: out-of-range knobs from the models
        print(f"error: {exc}", file=sys.stderr)
        return 2
    assumes = assumptions(args)
    unpinned = versus(free, result.best, result.memory_budget_gb) if free else ""
    if args.json:
        record = {**result.to_json(), "assumes": assumes}
        if free:
            record["unpinned"] = {
                "layout": free.layout.describe(),
                "step_time_s": round(free.step_time.total_s, 6),
                "versus_pinned": unpinned,
            }
        print(json.dumps(record, sort_keys=True))
    else:
        text = format_plan(name, shape, topo, result, args.seq_len, assumes, batch)
        print(text + (f"\n\nunpinned {unpinned}" if free else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="raytrain-dt plan", description=__doc__.splitlines()[0])
    add_plan_arguments(parser)
    return run_plan(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
