"""The peer under the same fault: Ray Train's TorchTrainer with elastic `num_workers=(min, max)`
on a simulated two-node cluster (`ray.cluster_utils.Cluster`, like `control/cluster.py`).

`train_fn` trains the same model, layout kind (FSDP2 ZeRO-3 over all workers), global batch and
sample order as `raytrain-dt train`, checkpoints through `ray.train.report` every
`checkpoint_every` steps (DCP, so a restart at another size reshards), resumes from
`ray.train.get_checkpoint()`, and has rank 0 append `{time, step, world_size}` per step to a
progress file. `run` removes a node once training has reached `kill_at_step`, times the first
step completed at the smaller size, adds the node back and watches whether it grows again.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

# Ray Train's default waits 60 s for a worker group that cannot start; STACK-NOTES measured
# 73 s to shrink with it and 33 s with 10 s. We give Ray Train the faster setting.
START_TIMEOUT_ENV = {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "10"}


def train_fn(config: dict) -> None:
    import ray.train
    import torch
    import torch.distributed as dist

    from raytrain_dt.accel.device import select_device
    from raytrain_dt.config import load_config
    from raytrain_dt.data.order import rank_positions, sample_ids
    from raytrain_dt.data.source import TokenDataset
    from raytrain_dt.engines.base import EngineBuild
    from raytrain_dt.engines.factory import build_engine
    from raytrain_dt.models.model_spec import model_spec
    from raytrain_dt.parallel.device_mesh import build_mesh
    from raytrain_dt.topology.layout import Layout
    from raytrain_dt.topology.parallel_dims import ParallelDims

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = load_config(config["recipe"], config["overrides"])
    gb = cfg.trainer.global_batch
    layout = Layout(ParallelDims(world_size=world, dp_shard=world), 3, gb // world, 1)
    device = select_device(cfg.engine.precision)
    mesh = build_mesh(layout.dims, device.device_type)
    engine = build_engine(EngineBuild(model_spec(cfg), cfg, layout, mesh, device))
    dataset = TokenDataset.open(cfg.data.path, cfg.data.seq_len)
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as directory:
            engine.load(directory)
            start = json.loads((Path(directory) / "step.json").read_text())["step"]
    progress, stop_file = Path(config["progress"]), Path(config["stop_file"])
    for step in range(start, cfg.trainer.steps):
        if stop_file.exists():
            break
        positions = rank_positions(step * gb, 1, gb, world, rank)
        ids = sample_ids(positions, dataset.num_samples, cfg.data.shuffle_seed)
        result = engine.train_step(
            list(torch.from_numpy(dataset.read(ids)).split(gb // world)), step
        )
        if rank == 0:
            with progress.open("a") as out:
                out.write(
                    json.dumps(
                        {
                            "time": time.time(),
                            "step": step + 1,
                            "world_size": world,
                            "loss": result.loss,
                        }
                    )
                    + "\n"
                )
        time.sleep(config["step_delay_s"])
        if (step + 1) % config["checkpoint_every"] == 0:
            directory = Path(config["scratch"]) / f"ckpt_{step + 1}_{world}"
            engine.save(str(directory))  # collective: every rank writes its shards
            if rank == 0:
                (directory / "step.json").write_text(json.dumps({"step": step + 1}))
            dist.barrier()
            ray.train.report(
                {"step": step + 1},
                checkpoint=(
                    ray.train.Checkpoint.from_directory(str(directory)) if rank == 0 else None
                ),
            )


def _read(progress: Path) -> list[dict]:
    if not progress.exists():
        return []
    return [json.loads(line) for line in progress.read_text().splitlines() if line.strip()]


def _wait_for(progress: Path, predicate, timeout_s: float) -> dict | None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        for record in _read(progress):
            if predicate(record):
                return record
        time.sleep(0.05)
    return None


def run(
    recipe: str,
    overrides: list[str],
    scratch: Path,
    accelerators_per_node: int,
    kill_at_step: int,
    checkpoint_every: int,
    step_delay_s: float,
    recover_timeout_s: float,
    grow_window_s: float,
) -> dict:
    """One elastic Ray Train run with a node lost and re-added; returns what was measured."""
    import ray
    import ray.cloudpickle
    import ray_train_elastic
    from ray.cluster_utils import Cluster
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from raytrain_dt.control.cluster import SIMULATED_SYSTEM_CONFIG

    os.environ.update(START_TIMEOUT_ENV)
    ray.cloudpickle.register_pickle_by_value(ray_train_elastic)
    scratch.mkdir(parents=True, exist_ok=True)
    progress, stop_file = scratch / "progress.jsonl", scratch / "stop"
    for path in (progress, stop_file):
        path.unlink(missing_ok=True)
    node_args = {
        "num_cpus": accelerators_per_node,
        "resources": {"accelerator": accelerators_per_node},
    }
    temp_dir = tempfile.mkdtemp(prefix="rtel_", dir="/tmp")  # short: Ray's socket paths
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 4,
            "include_dashboard": False,
            "temp_dir": temp_dir,
            "_system_config": SIMULATED_SYSTEM_CONFIG,  # as raytrain-dt's simulated cluster
        },
    )
    workers = [cluster.add_node(**node_args) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(
        address=cluster.address, log_to_driver=False, runtime_env={"env_vars": START_TIMEOUT_ENV}
    )
    max_workers = 2 * accelerators_per_node
    trainer = TorchTrainer(
        train_fn,
        train_loop_config={
            "recipe": recipe,
            "overrides": overrides,
            "progress": str(progress),
            "stop_file": str(stop_file),
            "scratch": str(scratch),
            "checkpoint_every": checkpoint_every,
            "step_delay_s": step_delay_s,
        },
        scaling_config=ScalingConfig(
            num_workers=(accelerators_per_node, max_workers),
            use_gpu=False,
            resources_per_worker={"CPU": 0.25, "accelerator": 1},
        ),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(
            storage_path=str(scratch / "storage"),
            name="elastic",
            failure_config=FailureConfig(max_failures=5),
        ),
    )
    outcome: dict = {}
    fit = threading.Thread(target=lambda: outcome.update(result=_fit(trainer)), daemon=True)
    fit.start()
    measured: dict = {"min_workers": accelerators_per_node, "max_workers": max_workers}
    try:
        before = _wait_for(
            progress,
            lambda r: r["step"] >= kill_at_step and r["world_size"] == max_workers,
            recover_timeout_s,
        )
        if before is None:
            raise RuntimeError(
                f"Ray Train did not reach step {kill_at_step} at {max_workers} workers"
            )
        killed_at = time.time()
        cluster.remove_node(workers[1], allow_graceful=False)
        last_before = max(r["step"] for r in _read(progress) if r["time"] <= killed_at)
        after = _wait_for(
            progress,
            lambda r: r["time"] > killed_at and r["world_size"] < max_workers,
            recover_timeout_s,
        )
        measured["recovered"] = after is not None
        if after is not None:
            measured["recovery_s"] = after["time"] - killed_at
            measured["world_size_after"] = after["world_size"]
            measured["lost_steps"] = max(0, last_before - (after["step"] - 1))
        added_at = time.time()
        cluster.add_node(**node_args)
        grown = _wait_for(
            progress,
            lambda r: r["time"] > added_at and r["world_size"] == max_workers,
            grow_window_s,
        )
        measured["grew_back"] = grown is not None
        measured["grow_window_s"] = grow_window_s
        if grown is not None:
            measured["grow_s"] = grown["time"] - added_at
    finally:
        stop_file.touch()
        fit.join(timeout=60)
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
    measured["fit_error"] = outcome.get("result")
    return measured


def _fit(trainer) -> str | None:
    try:
        trainer.fit()
    except Exception as exc:  # reported, not raised: the measurement is what matters
        return f"{type(exc).__name__}: {str(exc)[:300]}"
    return None
