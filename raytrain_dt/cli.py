"""`raytrain-dt` command line: train, doctor, prepare-data, plan, ckpt, report, status, simulate.

User errors (`UserError`) print one line to stderr and exit with code 2; anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from pathlib import Path

from raytrain_dt.ckpt_cli import add_ckpt_arguments
from raytrain_dt.doctor.doctor_cli import add_doctor_arguments
from raytrain_dt.errors import UserError
from raytrain_dt.sim.simulate_cli import add_simulate_arguments
from raytrain_dt.topology.plan_cli import add_plan_arguments


def _train(args: argparse.Namespace) -> int:
    from raytrain_dt.config import load_config
    from raytrain_dt.control.coordinator import train
    from raytrain_dt.errors import UserError

    cfg = load_config(args.config, args.overrides)
    if args.address:
        cfg.cluster.address = args.address
    from tqdm.contrib.logging import logging_redirect_tqdm

    from raytrain_dt.observe.report import report_after_run

    started = time.perf_counter()
    try:
        with logging_redirect_tqdm():  # step log lines print above the progress bar
            result = train(cfg)
    except UserError:
        raise  # bad input: nothing trained, so an earlier run's report stays as it was
    except BaseException:
        report_after_run(cfg.run.dir)  # a failed run gets its report: where the time went
        raise
    report_after_run(cfg.run.dir)
    print(
        f"run {'stopped' if result.stopped else 'finished'} at step {result.final_step} in "
        f"{time.perf_counter() - started:.1f}s: "
        f"loss {result.last_metrics.get('loss', float('nan')):.4f}\n"
        f"run dir: {result.run_dir}\n"
        f"latest checkpoint: {result.latest_checkpoint}"
    )
    # Stopped (SIGTERM, `ray job stop`): checkpointed, not finished; the same run.dir resumes.
    return 128 + signal.SIGTERM if result.stopped else 0


def _doctor(args: argparse.Namespace) -> int:
    from raytrain_dt.doctor.doctor_cli import run_doctor

    return run_doctor(args)


def _report(args: argparse.Namespace) -> int:
    from raytrain_dt.observe.report import format_summary, render_report

    if not (Path(args.run_dir) / "events.jsonl").exists():
        raise UserError(f"RUN_DIR: {args.run_dir} has no events.jsonl (not a run directory?)")
    report = render_report(args.run_dir)
    print(format_summary(report.summary))
    print(f"report: {report.html}")
    return 0


def _status(args: argparse.Namespace) -> int:
    from raytrain_dt.observe.status import show_status

    return show_status(args.address, args.run_dir, args.all)


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


def _simulate(args: argparse.Namespace) -> int:
    from raytrain_dt.sim.simulate_cli import run_simulate

    return run_simulate(args)


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

    p = sub.add_parser(
        "doctor",
        help="check a cluster before a long job: versions, GPUs, all-reduce bandwidth, "
        "a step per engine, reuse after a killed rank, disk",
    )
    add_doctor_arguments(p)
    p.set_defaults(func=_doctor)

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

    p = sub.add_parser("simulate", help="compare elastic policies on a simulated cluster trace")
    add_simulate_arguments(p)
    p.set_defaults(func=_simulate)

    p = sub.add_parser("report", help="write RUN_DIR/report.html (plots, goodput) and summarize")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.set_defaults(func=_report)

    p = sub.add_parser("status", help="state, layout, step, tokens/s of runs on a live cluster")
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        nargs="?",
        help="a run directory or run name (default: the most recently updated live run)",
    )
    which.add_argument("--all", action="store_true", help="every live run on the cluster")
    p.add_argument("--address", help="Ray cluster (default: RAY_ADDRESS, else the local one)")
    p.set_defaults(func=_status)
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
