"""`raytrain-dt simulate`: the three policies on one cluster trace; table, JSON, plots, report."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from raytrain_dt.errors import UserError
from raytrain_dt.models.presets import PRESETS
from raytrain_dt.sim.costs import Costs
from raytrain_dt.sim.strategies import POLICY_NAMES
from raytrain_dt.sim.trace import DAY, TraceSpec, load_trace, synthetic_trace
from raytrain_dt.topology.plan_cli import DEFAULT_TOKENS_PER_STEP

DEFAULT_CKPT_MINUTES = 10.0
SWEEP_MINUTES = (2.5, 5.0, 10.0, 20.0, 40.0)


def add_simulate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=1024)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--days", type=float, default=7.0)
    p.add_argument("--model", choices=sorted(PRESETS), default="llama-70b")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--global-batch", type=int, help="sequences per step (default: about 4M tokens)")
    p.add_argument(
        "--batch-tolerance",
        type=float,
        default=0.0,
        help="trainer.batch_tolerance for ours: the fraction by which the global batch may "
        "drop while nodes are missing (default 0: a fixed batch)",
    )
    p.add_argument(
        "--memory-every-steps",
        type=int,
        default=1,
        help="checkpoint.memory_every_steps for ours: steps between in-memory copies "
        "(default 1; 0: none)",
    )
    p.add_argument(
        "--trace", help="a JSON or CSV trace (raytrain_dt/sim/trace.py); default: synthetic"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic trace")
    p.add_argument("--out", required=True, help="directory for simulation.json, plots, report.md")
    p.add_argument("--ckpt-every", type=int, help="steps between checkpoints (default: ~10 min)")
    p.add_argument(
        "--sweep",
        help="comma-separated checkpoint intervals in steps "
        "(default: about 2.5, 5, 10, 20, 40 minutes of steps)",
    )
    p.add_argument("--policies", default=",".join(POLICY_NAMES))
    p.add_argument("--spot-price", type=float, default=Costs.spot_usd_per_gpu_h, help="$/GPU-hour")
    p.add_argument(
        "--on-demand-price", type=float, default=Costs.on_demand_usd_per_gpu_h, help="$/GPU-hour"
    )
    for f in dataclasses.fields(TraceSpec):
        if f.name not in ("nodes", "duration_s", "seed"):
            p.add_argument(
                f"--{f.name.replace('_', '-')}",
                type=type(f.default),
                default=f.default,
                help="synthetic trace",
            )
    p.add_argument(
        "--cost",
        action="append",
        default=[],
        metavar="KEY=SECONDS",
        help="override a cost (detection_s, reform_s, ckpt_save_s, ...)",
    )
    p.add_argument(
        "--elastic",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override elastic.* for the policy (e.g. grow_stable_s=600)",
    )


def _pairs(items: list[str], allowed: set[str], flag: str) -> dict[str, float]:
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        if key not in allowed:
            raise UserError(f"{flag}: {key!r} is not one of {', '.join(sorted(allowed))}")
        try:
            out[key] = float(value)
        except ValueError:
            raise UserError(f"{flag}: {item!r} needs a number after '='") from None
    return out


def run_simulate(args: argparse.Namespace) -> int:
    from raytrain_dt.config.schema import ElasticConfig
    from raytrain_dt.sim.comparison_report import summary, write_report
    from raytrain_dt.sim.runner import Setup, compare, scale_config
    from raytrain_dt.sim.sim_planner import SimPlanner

    if args.nodes < 1 or args.gpus_per_node < 1 or args.days <= 0:
        raise UserError("--nodes, --gpus-per-node and --days must be positive")
    if not 0.0 <= args.batch_tolerance < 1.0:
        raise UserError(f"--batch-tolerance: must be in [0, 1), got {args.batch_tolerance}")
    if args.memory_every_steps < 0:
        raise UserError(f"--memory-every-steps: must be >= 0, got {args.memory_every_steps}")
    names = tuple(n.strip() for n in args.policies.split(",") if n.strip())
    cost_keys = {f.name for f in dataclasses.fields(Costs) if f.name != "step_s_by_world"}
    costs = Costs(
        **{
            **_pairs(args.cost, cost_keys, "--cost"),
            "spot_usd_per_gpu_h": args.spot_price,
            "on_demand_usd_per_gpu_h": args.on_demand_price,
        }
    )
    elastic = _pairs(args.elastic, {f.name for f in dataclasses.fields(ElasticConfig)}, "--elastic")
    batch = args.global_batch or max(1, round(DEFAULT_TOKENS_PER_STEP / args.seq_len))
    cfg = scale_config(
        args.model, args.gpus_per_node, args.seq_len, batch, elastic, args.batch_tolerance
    )
    memory = args.memory_every_steps
    setup = Setup(SimPlanner(cfg), costs, args.gpus_per_node, args.nodes, cfg.elastic, memory)
    duration = args.days * DAY
    if args.trace:
        trace = load_trace(args.trace, args.nodes, duration)
    else:
        knobs = {
            f.name: getattr(args, f.name)
            for f in dataclasses.fields(TraceSpec)
            if f.name not in ("nodes", "duration_s", "seed")
        }
        trace = synthetic_trace(
            TraceSpec(nodes=args.nodes, duration_s=duration, seed=args.seed, **knobs)
        )
    if trace.nodes != args.nodes:
        setup = Setup(setup.planner, costs, args.gpus_per_node, trace.nodes, cfg.elastic, memory)
    minutes = 60 / setup.best_step_s
    every = args.ckpt_every or max(1, round(DEFAULT_CKPT_MINUTES * minutes))
    if args.sweep:
        try:
            sweep = [int(s) for s in args.sweep.split(",")]
        except ValueError:
            raise UserError(
                f"--sweep: {args.sweep!r} is not a comma-separated list of steps"
            ) from None
    else:
        sweep = [max(1, round(m * minutes)) for m in SWEEP_MINUTES]
    if min([every, *sweep]) < 1:
        raise UserError("--ckpt-every/--sweep: intervals must be >= 1 step")
    result = compare(setup, trace, every, sweep, names)
    report = write_report(result, args.out)
    print(summary(result))
    print(f"wrote {Path(args.out) / 'simulation.json'}, plots and {report}")
    return 0
