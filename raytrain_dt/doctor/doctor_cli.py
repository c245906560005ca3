"""`raytrain-dt doctor [RECIPE] [overrides] [--device KIND] [--json]`: run every check on the
cluster (the recipe's `cluster.address`, RAY_ADDRESS, or an embedded one) and print PASS, FAIL
or SKIP per check; exit 1 if any failed.

The devices checked: those named with --device, else `cuda` where Ray sees GPUs, else both
`cpu` and `emulated` (the CPU stand-in for CUDA + NCCL). Without a recipe the embedded cluster
has two simulated nodes, so the collective crosses nodes as on a real cluster (on a GPU machine:
the machine itself, one node with its GPUs).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import socket
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from raytrain_dt.config import load_config
from raytrain_dt.config.schema import TrainConfig
from raytrain_dt.doctor import checks
from raytrain_dt.doctor.result import Check, format_json, format_table

# Without a recipe: two simulated nodes of one accelerator each, so the collective crosses
# nodes; on a machine with GPUs, the machine itself (one node with its real GPUs: simulated
# nodes would each claim every GPU).
EMBEDDED_DEFAULT = ["cluster.local_nodes=2", "cluster.accelerators_per_node=1"]
EMBEDDED_GPU_DEFAULT = ["cluster.local_nodes=1"]
# The training checks' corpus: a few hundred kB of the standard library, tokenized per node.
CORPUS_TOKENS, CORPUS_SEQ_LEN = 200_000, 64


def add_doctor_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config",
        nargs="?",
        help="the recipe you will run (its cluster, "
        "model and checkpoint.dir are checked against); default: a tiny model",
    )
    parser.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. cluster.address=…")
    parser.add_argument(
        "--device",
        action="append",
        choices=("cpu", "cuda", "emulated"),
        help="device to check (repeatable); default: cuda where Ray sees GPUs, "
        "else cpu and emulated",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--work-dir",
        help="where the training checks write (default: a temporary directory, removed afterwards)",
    )


def devices_to_check(requested: list[str] | None, cluster_gpus: float) -> list[str]:
    if requested:
        return list(dict.fromkeys(requested))
    return ["cuda"] if cluster_gpus >= 1 else ["cpu", "emulated"]


def run_doctor(args: argparse.Namespace) -> int:
    config, overrides = args.config, list(args.overrides)
    if config and "=" in config and not Path(config).exists():  # an override, not a recipe
        config, overrides = None, [config, *overrides]
    if not config:
        import torch

        embedded = EMBEDDED_GPU_DEFAULT if torch.cuda.is_available() else EMBEDDED_DEFAULT
        overrides = [*embedded, *overrides]
    recipe = load_config(config, overrides)
    with tempfile.TemporaryDirectory(prefix="raytrain_dt_doctor_") as scratch:
        work_dir = Path(args.work_dir or scratch)
        # With --json, stdout carries the JSON alone: what Ray and the runs print goes to stderr.
        with _stdout_to_stderr() if args.json else contextlib.nullcontext():
            results = _run_checks(recipe, args.device, work_dir)
    print(format_json(results) if args.json else format_table(results))
    return 1 if any(c.failed for c in results) else 0


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send stdout to stderr: `sys.stdout` (Ray's error thread prints through it) and file
    descriptor 1 (what subprocesses and C code write)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _run_checks(recipe: TrainConfig, requested: list[str] | None, work_dir: Path) -> list[Check]:
    import ray

    from raytrain_dt.control.cluster import connect, resolve_accelerator_resource

    results: list[Check] = []
    with connect(recipe.cluster, tempfile.mkdtemp(prefix="rtdt_", dir="/tmp")):
        resource = resolve_accelerator_resource(recipe.cluster)
        kinds = devices_to_check(requested, ray.cluster_resources().get("GPU", 0))
        probes = checks.start_probes(resource, recipe.cluster.cpus_per_rank)
        try:
            results.append(checks.check_versions(probes))
            for kind in kinds:
                results.append(checks.check_accelerators(resource, kind, probes))
                results.append(checks.check_all_reduce(kind, probes))
            data = work_dir / "corpus"
            _prepare_corpus_everywhere(data, probes)
        finally:
            probes.close()
        ranks = min(2, len(probes.handles))
        for kind in kinds:
            results += checks.check_training(
                kind, _training_config(recipe, data, work_dir, ranks), ranks
            )
        plan = checks.plan_recipe(recipe, resource)
        results.append(checks.check_host_memory(plan))
    results.append(_disk_check(recipe, plan, resource == "GPU"))
    return results


def _training_config(recipe: TrainConfig, data: Path, work_dir: Path, ranks: int):
    """The training checks' config: a tiny model on the recipe's cluster, checkpointing every
    step (under the recipe's checkpoint.dir when it sets one: on a real cluster that is the
    storage every node shares)."""

    def make(kind: str, engine: str, *extra: str) -> TrainConfig:
        name = f"{kind}-{engine}"
        cfg = load_config(
            None,
            [
                f"run.name=doctor-{name}",
                f"run.dir={work_dir / name}",
                "model.preset=tiny",
                f"data.path={data}",
                f"data.seq_len={CORPUS_SEQ_LEN}",
                f"trainer.steps={checks.TRAIN_STEPS}",
                "trainer.global_batch=4",
                "trainer.warmup_steps=1",
                f"engine.name={engine}",
                "checkpoint.every_steps=1",
                "elastic.min_nodes=1",
                *extra,
            ],
        )
        if recipe.checkpoint.dir:
            cfg.checkpoint.dir = f"{recipe.checkpoint.dir.rstrip('/')}/doctor/{name}"
        cfg.cluster = dataclasses.replace(recipe.cluster, device=kind, num_ranks=ranks)
        return cfg

    return make


def _prepare_corpus_everywhere(path: Path, probes: checks.Probes) -> None:
    """Rank actors read the corpus from their own node's disk: write it on every host."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from raytrain_dt.data.prepare import prepare_dataset

    prepare_dataset(path, None, CORPUS_SEQ_LEN, CORPUS_TOKENS)
    here = socket.gethostbyname(socket.gethostname())
    remote = {f["ip"]: f["node_id"] for f in probes.facts if f["ip"] != here}
    prepare = ray.remote(num_cpus=0)(prepare_dataset)
    ray.get(
        [
            prepare.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
            ).remote(path, None, CORPUS_SEQ_LEN, CORPUS_TOKENS)
            for node in remote.values()
        ]
    )


def _disk_check(recipe: TrainConfig, plan: checks.RecipePlan, on_gpu: bool) -> Check:
    """Disk for the recipe's checkpoints: its model's size as its engine saves it, at the
    planned layout (its ZeRO stage) and precision; the memory model's default stage when
    nothing was planned."""
    from raytrain_dt.models.model_spec import model_spec
    from raytrain_dt.topology.host_memory import checkpoint_bytes
    from raytrain_dt.topology.precision import resolve_precision
    from raytrain_dt.topology.run_plan import planned_checkpoint_bytes

    shape = model_spec(recipe).shape
    if plan.best is not None:
        size = planned_checkpoint_bytes(recipe, shape, plan.best.layout, on_gpu)
    else:
        precision = resolve_precision(recipe.engine.precision, on_gpu)
        size = checkpoint_bytes(shape, engine=recipe.engine.name, precision=precision)
    root = recipe.checkpoint.dir or str(Path(recipe.run.dir) / "checkpoints")
    return checks.check_disk(root, size, recipe.checkpoint.keep_last)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="raytrain-dt doctor")
    add_doctor_arguments(parser)
    return run_doctor(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
