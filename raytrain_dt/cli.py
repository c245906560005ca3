"""`raytrain-dt` command line: train, prepare-data, plan.

User errors (`UserError`) print one line to stderr and exit with code 2; anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from raytrain_dt.checkpoint.cli import add_ckpt_arguments
from raytrain_dt.errors import UserError
from raytrain_dt.topology.plan_cli import add_plan_arguments


def _train(args: argparse.Namespace) -> int:
    from raytrain_dt.config import load_config
    from raytrain_dt.control.coordinator import train

    cfg = load_config(args.config, args.overrides)
    if args.address:
        cfg.cluster.address = args.address
    started = time.perf_counter()
    result = train(cfg)
    print(
        f"run finished at step {result.final_step} in {time.perf_counter() - started:.1f}s: "
        f"loss {result.last_metrics.get('loss', float('nan')):.4f}\n"
        f"run dir: {result.run_dir}\n"
        f"latest checkpoint: {result.latest_checkpoint}"
    )
    return 0


def _prepare_data(args: argparse.Namespace) -> int:
    from raytrain_dt.data.prepare import prepare_dataset

    meta = prepare_dataset(args.out, args.text_glob, args.seq_len, args.max_tokens)
    print(
        f"{meta['num_samples']} sequences of {meta['seq_len']} tokens from "
        f"{meta['num_files']} files -> {args.out}"
    )
    return 0


def _plan(args: argparse.Namespace) -> int:
    from raytrain_dt.topology.plan_cli import run_plan

    return run_plan(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raytrain-dt", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "train", help="train from a recipe (embedded local Ray unless an address is set)"
    )
    p.add_argument("config", help="recipe YAML, e.g. conf/tiny.yaml")
    p.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. trainer.steps=30")
    p.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else embedded)")
    p.set_defaults(func=_train)

    p = sub.add_parser("prepare-data", help="tokenize text files into a parquet dataset")
    p.add_argument("--out", required=True)
    p.add_argument("--text-glob", default=None, help="default: the Python standard library sources")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=None)
    p.set_defaults(func=_prepare_data)

    p = sub.add_parser("plan", help="plan a parallel layout for a model on a cluster")
    add_plan_arguments(p)
    p.set_defaults(func=_plan)

    p = sub.add_parser("ckpt", help="list, inspect and export checkpoints")
    add_ckpt_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
