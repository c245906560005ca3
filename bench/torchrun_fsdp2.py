"""The baseline a user would write by hand: one FSDP2 training function, no orchestration.

`train_fn(config)` builds the same model, layout and FSDP2 engine as `raytrain-dt train`,
reads the same global batches in the same order (the deterministic order of `data.order`, read
straight from the parquet files, no Ray Data), and times each step from fetching its batch to
the end of the optimizer step, as our train loop does, and when each step ended. Rank 0 writes
them and the losses to `config["out"]` as JSON.

The same function runs under torchrun (this file's __main__) and under Ray Train's
TorchTrainer (bench_overhead.py), which initialises the process group itself.
Run: torchrun --nproc-per-node 2 bench/torchrun_fsdp2.py CONFIG_JSON
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def train_fn(config: dict) -> None:
    import torch
    import torch.distributed as dist

    from raytrain_dt.accel.device import select_device
    from raytrain_dt.config import load_config
    from raytrain_dt.data.input_pipeline import DataSlice
    from raytrain_dt.data.order import sample_ids
    from raytrain_dt.data.source import TokenDataset
    from raytrain_dt.engines.base import EngineBuild
    from raytrain_dt.engines.factory import build_engine
    from raytrain_dt.models.model_spec import model_spec
    from raytrain_dt.parallel.device_mesh import build_mesh
    from raytrain_dt.topology.layout import Layout

    started = time.perf_counter()
    if not dist.is_initialized():  # under torchrun; Ray Train has initialised it already
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = load_config(config["recipe"], config["overrides"])
    layout = Layout.from_dict(config["layout"])
    dims = layout.dims
    device = select_device(cfg.engine.precision)
    mesh = build_mesh(dims, device.device_type)
    engine = build_engine(EngineBuild(model_spec(cfg), cfg, layout, mesh, device))
    dataset = TokenDataset.open(cfg.data.path, cfg.data.seq_len)
    steps = cfg.trainer.steps
    data = DataSlice(
        dataset=dataset,
        shuffle_seed=cfg.data.shuffle_seed,
        consumed_samples=0,
        num_steps=steps,
        global_batch=layout.global_batch,
        dp=dims.dp,
        dp_rank=dims.coords(rank).dp,
        micro_batch=layout.micro_batch,
    )
    positions = data.positions()
    per_step = layout.global_batch // dims.dp
    ready = time.perf_counter() - started
    step_times, step_ends, losses = [], [], []
    for step in range(steps):
        t0 = time.perf_counter()
        ids = sample_ids(
            positions[step * per_step : (step + 1) * per_step],
            dataset.num_samples,
            cfg.data.shuffle_seed,
        )
        tokens = torch.from_numpy(dataset.read(ids))
        result = engine.train_step(list(tokens.split(layout.micro_batch)), step)
        step_times.append(time.perf_counter() - t0)
        step_ends.append(time.time())
        losses.append(result.loss)
    if rank == 0:
        Path(config["out"]).write_text(
            json.dumps(
                {
                    "step_times": step_times,
                    "step_ends": step_ends,
                    "losses": losses,
                    "setup_s": ready,
                }
            )
        )
    if config.get("destroy", True):
        dist.destroy_process_group()


if __name__ == "__main__":
    train_fn(json.loads(Path(sys.argv[1]).read_text()))
