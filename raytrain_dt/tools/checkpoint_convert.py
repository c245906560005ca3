"""Convert a committed checkpoint between engines: FSDP2 (DCP) <-> DeepSpeed ZeRO.

Model weights and AdamW state (exp_avg, exp_avg_sq, step) go through one engine-free form: full
fp32 tensors per parameter name. Each side is read and written by the engine that owns the
format, in this process, at world size 1 (a gloo group on a free local port, no Ray):
DeepSpeed through a DeepSpeedEngine (its own save/load, and its tensor-fragment API to get and
set full per-parameter state), FSDP2 through DCP with the same flattened, name-keyed state dict
FSDP2Engine saves. The result is an ordinary 1-rank checkpoint, committed in the destination
store, so loading it at another world size reuses the engines' own reshard paths (DCP for
FSDP2, the universal conversion for DeepSpeed).

The whole model and optimizer state is held in memory once: conversion is an offline step.
This process is the one rank of both sides: it verifies the source's checksums before reading
it and hashes what it writes for the destination's commit record, as ranks do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from raytrain_dt.checkpoint.digests import FileDigests, verify_files
from raytrain_dt.checkpoint.record import RNG_DIR
from raytrain_dt.checkpoint.storage import Location, dcp_reader, dcp_writer
from raytrain_dt.checkpoint.store import CheckpointRef, CheckpointStore
from raytrain_dt.config.schema import TrainConfig
from raytrain_dt.errors import CheckpointError
from raytrain_dt.models.presets import ModelShape
from raytrain_dt.parallel.device_mesh import build_mesh
from raytrain_dt.topology.layout import Layout
from raytrain_dt.topology.parallel_dims import ParallelDims

log = logging.getLogger(__name__)

ENGINES = ("fsdp2", "deepspeed")
ADAM_FIELDS = ("exp_avg", "exp_avg_sq")

# name -> {"param": fp32, "exp_avg": fp32, "exp_avg_sq": fp32}; plus the shared AdamW step.
FullState = dict[str, dict[str, torch.Tensor]]


@contextlib.contextmanager
def single_process_group() -> Iterator[None]:
    """torch.distributed at world size 1, for the engines' collectives. Its store is in this
    process: no port to pick, so none another process could take first."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("convert runs its own 1-rank process group; one is already running")
    # What the engines read of a launcher's environment (DeepSpeed its device's LOCAL_RANK).
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def one_rank_layout(saved: dict, zero_stage: int) -> Layout:
    """The source's layout squeezed onto one rank (the whole global batch per micro-batch, no
    pipeline: the engines read and write every stage's parameters by the full model's names)."""
    layout = Layout.from_dict(saved)
    return dataclasses.replace(
        layout,
        dims=ParallelDims(world_size=1),
        zero_stage=zero_stage,
        micro_batch=layout.global_batch,
        grad_accum=1,
        sequence_parallel=False,
        pp_schedule="1f1b",
        virtual_stages=1,
        pp_layers=(),
    )


# --- FSDP2 (DCP) ---------------------------------------------------------------------------------
def read_flat_state(uri: str) -> dict:
    """Every entry of a DCP checkpoint, gathered in this process, by flattened key
    (`model.layers.0...`, `optim.state....`)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    return _flatten(_load_state_dict_from_keys(storage_reader=dcp_reader(uri)))


def read_fsdp2(uri: str) -> tuple[FullState, float]:
    """Full fp32 parameters and AdamW state by name from a DCP checkpoint (any layout)."""
    flat = read_flat_state(uri)
    state: FullState = {}
    steps = set()
    for key, value in flat.items():
        if key.startswith("model."):
            state.setdefault(key.removeprefix("model."), {})["param"] = value.float()
        elif key.startswith("optim.state."):
            name, field = key.removeprefix("optim.state.").rsplit(".", 1)
            if field == "step":
                steps.add(float(value))
            else:
                state.setdefault(name, {})[field] = value.float()
    if len(steps) > 1:
        raise ValueError(f"{uri}: parameters disagree on the AdamW step: {sorted(steps)}")
    return state, steps.pop() if steps else 0.0


def write_fsdp2(
    uri: str,
    state: FullState,
    step: float,
    shape: ModelShape,
    cfg: TrainConfig,
    digests: FileDigests | None = None,
) -> None:
    """A DCP checkpoint with the keys FSDP2Engine saves (plain tensors: DCP reshards them);
    `digests` records the files written."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from raytrain_dt.engines.fsdp2 import STATE_DICT_OPTIONS
    from raytrain_dt.engines.optim import build_adamw
    from raytrain_dt.models.llama import build_model

    model = build_model(shape, cfg.data.seq_len, cfg.run.seed)
    optimizer = build_adamw(model, cfg.trainer)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(state[name]["param"])
            optimizer.state[param] = {
                "step": torch.tensor(step, dtype=torch.float32),
                **{f: state[name][f].clone() for f in ADAM_FIELDS},
            }
    model_sd, optim_sd = get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
    dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=dcp_writer(uri, digests))


# --- DeepSpeed -----------------------------------------------------------------------------------
def _deepspeed_engine(shape: ModelShape, cfg: TrainConfig, layout: Layout):
    from raytrain_dt.accel.device import select_device
    from raytrain_dt.engines.base import EngineBuild
    from raytrain_dt.engines.deepspeed_engine import DeepSpeedEngine
    from raytrain_dt.models.model_spec import llama_spec

    device = select_device("fp32")  # master weights and Adam moments are fp32 in both formats
    mesh = build_mesh(layout.dims, device.device_type)
    return DeepSpeedEngine(EngineBuild(llama_spec(shape), cfg, layout, mesh, device))


def _named_params(engine) -> dict[str, torch.nn.Parameter]:
    return dict(engine.engine.module.named_parameters())


def _inner_optimizer(engine):
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


def read_deepspeed(uri: str, shape: ModelShape, cfg: TrainConfig, layout: Layout):
    """Full fp32 parameters and AdamW state by name; a checkpoint of another DP size is
    resharded by the engine's own loader first."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    engine = _deepspeed_engine(shape, cfg, layout)
    engine.load(uri)
    state: FullState = {}
    for name, param in _named_params(engine).items():
        state[name] = {"param": safe_get_full_fp32_param(param).float().cpu().clone()}
        for field in ADAM_FIELDS:
            value = safe_get_full_optimizer_state(param, field)
            state[name][field] = value.float().cpu().clone()
    steps = {float(s["step"]) for s in _inner_optimizer(engine).state.values() if "step" in s}
    if len(steps) > 1:
        raise ValueError(f"{uri}: parameter groups disagree on the AdamW step: {sorted(steps)}")
    return state, steps.pop() if steps else 0.0


def write_deepspeed(
    uri: str,
    state: FullState,
    step: float,
    shape: ModelShape,
    cfg: TrainConfig,
    layout: Layout,
    digests: FileDigests | None = None,
) -> None:
    """DeepSpeed's own checkpoint (`<uri>/ds`) of a 1-rank engine holding `state`; `digests`
    records the files written."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    engine = _deepspeed_engine(shape, cfg, layout)
    inner = _inner_optimizer(engine)
    # ZeRO-3 creates AdamW state lazily at the first step, and lists its flat fp32 partitions
    # in the inner optimizer's groups only during a step; the setters need the state now.
    flats = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None) or [
        p for group in inner.param_groups for p in group["params"]
    ]
    for flat in flats:
        if not inner.state.get(flat):
            inner.state[flat] = {"step": torch.tensor(0.0)}
            inner.state[flat].update({f: torch.zeros_like(flat) for f in ADAM_FIELDS})
    # ZeRO-1/2 map each parameter onto its fragment of that state only at the first step
    # (ZeRO-3 at construction); without the map the optimizer-state setter has nowhere to write.
    link_state = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link_state is not None:
        link_state()
    with torch.no_grad():
        for name, param in _named_params(engine).items():
            value = state[name]["param"]
            safe_set_full_fp32_param(param, value)
            # The module's own copy too: DeepSpeed saves it as the model states, and ZeRO-3
            # keeps it as this rank's (here: the whole) flat partition.
            local = getattr(param, "ds_tensor", param)
            local.data.view(-1)[: value.numel()].copy_(value.reshape(-1))
            for field in ADAM_FIELDS:
                safe_set_full_optimizer_state(param, state[name][field], field)
    for group_state in inner.state.values():
        if "step" in group_state:
            # DeepSpeed's flat groups each hold one step; every parameter shares ours.
            group_state["step"] = torch.tensor(step, dtype=torch.float32)
    engine.save(uri, digests=digests)


# --- the command -----------------------------------------------------------------------------------
def convert(
    src: CheckpointRef,
    dst_root: str,
    to: str,
    zero_stage: int | None = None,
    cfg: TrainConfig | None = None,
) -> CheckpointRef:
    """Write `src` as a committed 1-rank checkpoint of engine `to` under `dst_root`."""
    if to not in ENGINES:
        raise ValueError(f"--to: {to!r} is not one of {', '.join(ENGINES)}")
    train_state = src.train_state
    source_engine = train_state.get("engine", "fsdp2")
    shape = ModelShape(**train_state["model_shape"])
    cfg = cfg or TrainConfig()
    saved_layout = train_state["layout"]
    stage = saved_layout["zero_stage"] if zero_stage is None else zero_stage
    store = CheckpointStore(dst_root)
    target = Location.parse(store.step_uri(src.step))
    if target.child("commit.json").exists():
        raise FileExistsError(f"{target.uri}: already holds a committed checkpoint")
    damage = verify_files(src.uri, src.record["files"])
    if damage:
        raise CheckpointError(f"{src.uri}: damaged, not converted: " + "; ".join(damage))
    written = FileDigests()
    with single_process_group():
        if source_engine == "fsdp2":
            state, step = read_fsdp2(src.uri)
        else:
            read_layout = one_rank_layout(saved_layout, saved_layout["zero_stage"])
            state, step = read_deepspeed(src.uri, shape, cfg, read_layout)
        log.info("read %d parameters at AdamW step %g from %s", len(state), step, src.uri)
        target.makedirs()
        new_layout = one_rank_layout(saved_layout, stage)
        if to == "fsdp2":
            write_fsdp2(target.uri, state, step, shape, cfg, written)
        else:
            write_deepspeed(target.uri, state, step, shape, cfg, new_layout, written)
    _copy_rng(Location.parse(src.uri), target, written)
    new_state = dict(
        train_state,
        engine=to,
        layout=new_layout.as_dict(),
        world_size=new_layout.dims.world_size,
        converted_from=src.uri,
    )
    return store.commit(src.step, new_state, written.manifest())


def _copy_rng(src: Location, dst: Location, written: FileDigests) -> None:
    """Per-rank RNG states are engine-free; ranks without one keep their seeded state."""
    rng = src.child(RNG_DIR)
    for name in rng.files():
        with rng.fs.open(rng.child(name).path, "rb") as f:
            data = f.read()
        out = dst.child(RNG_DIR, name)
        out.fs.makedirs(out.path.rsplit("/", 1)[0], exist_ok=True)
        with out.fs.open(out.path, "wb") as f:
            f.write(data)
        written.add_bytes(f"{RNG_DIR}/{name}", data)


def run_config(src: CheckpointRef, config_path: str | None) -> TrainConfig:
    """Hyperparameters for the written optimizer state: --config, else the run's config.yaml
    next to the checkpoints directory, else the defaults (FSDP2 restores AdamW's betas, eps
    and weight decay from the checkpoint, so they should be the run's)."""
    from raytrain_dt.config.load import load_config

    if config_path:
        return load_config(config_path)
    src_loc = Location.parse(src.uri)
    if src_loc.is_local:
        candidate = Path(src_loc.path).parent.parent / "config.yaml"
        if candidate.is_file():
            return load_config(candidate)
    log.warning("%s: no run config found; writing default AdamW hyperparameters", src.uri)
    return TrainConfig()


def _flatten(state: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
