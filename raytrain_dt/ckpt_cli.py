"""`raytrain-dt ckpt ls|inspect|consolidate|convert`: look at, export and convert checkpoints
without a cluster."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from raytrain_dt.checkpoint.digests import verify_files
from raytrain_dt.checkpoint.record import RNG_DIR
from raytrain_dt.checkpoint.storage import Location
from raytrain_dt.checkpoint.store import COMMIT_FILE, CheckpointRef, CheckpointStore
from raytrain_dt.errors import CheckpointError
from raytrain_dt.models.presets import ModelShape


def resolve(path: str) -> tuple[CheckpointStore, CheckpointRef]:
    """A checkpoint directory, or a run directory (its newest intact checkpoint)."""
    loc = Location.parse(path)
    if not loc.exists():
        raise CheckpointError(f"{path}: does not exist")
    if loc.child(COMMIT_FILE).exists() or loc.path.rstrip("/").rsplit("/", 1)[-1].startswith(
        "step_"
    ):
        parent = path.rstrip("/").rsplit("/", 1)[0]
        store = CheckpointStore(parent)
        for ref in store.list():
            if ref.uri.rstrip("/") == loc.uri.rstrip("/"):
                return store, ref
    for root in (loc.child("checkpoints"), loc):
        store = CheckpointStore(root.uri)
        if store.list():
            ref = store.latest_valid()
            if ref is None:
                raise CheckpointError(f"{path}: no committed, intact checkpoint")
            return store, ref
    raise CheckpointError(f"{path}: holds no checkpoint")


def _state(store: CheckpointStore, ref: CheckpointRef, checksums: bool = False) -> str:
    """Metadata only (commit record, names, sizes) unless `checksums`: then every file is read
    here and hashed, as the ranks do before they load."""
    problems = store.problems(ref)
    if not problems and checksums:
        problems = verify_files(ref.uri, ref.record["files"])
    if problems:
        return "; ".join(problems)
    return "committed, intact" if checksums else "committed, files present at recorded sizes"


def cmd_ls(args: argparse.Namespace) -> int:
    _, ref = resolve(args.run)
    store = CheckpointStore(ref.uri.rstrip("/").rsplit("/", 1)[0])
    for item in store.list():
        total = sum(f["size"] for f in item.record.get("files", {}).values())
        print(f"step {item.step:>8}  {total / 1e6:10.2f} MB  {_state(store, item)}  {item.uri}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from raytrain_dt.checkpoint.export import model_tensors

    store, ref = resolve(args.path)
    state = ref.train_state
    files = ref.record.get("files", {})
    layout = state.get("layout", {})
    dims = layout.get("dims", {})
    if state.get("tensors"):  # recorded by the rank that saved it, for every engine
        shapes = [tuple(s) for s in state["tensors"].values()]
    elif ".metadata" in files:  # DCP's own metadata (fsdp2 checkpoints)
        shapes = [tuple(size) for size, _ in model_tensors(ref.uri).values()]
    else:
        shapes = []
    schedule = state.get("lr_scheduler", {})
    versions = state.get("versions") or {"torch": state.get("torch_version")}
    degrees = {k: v for k, v in dims.items() if k != "world_size"}
    print(f"checkpoint: {ref.uri}")
    print(
        f"step: {ref.step}   consumed samples: {ref.consumed_samples}   "
        f"tokens: {state.get('tokens', 'unrecorded')}"
    )
    print(
        f"engine: {state.get('engine')}   world size: {dims.get('world_size')}   "
        f"zero={layout.get('zero_stage')}   degrees: {degrees}"
    )
    print(
        f"model: preset {state.get('model_preset') or state.get('model_hf')}   "
        f"shape {state.get('model_shape')}   seq_len {state.get('seq_len')}"
    )
    print(f"model tensors: {len(shapes)}   parameters: {sum(math.prod(s) for s in shapes)}")
    if schedule:
        print("lr scheduler: " + ", ".join(f"{k}={v}" for k, v in schedule.items()))
    rng = Location.parse(ref.uri).child(RNG_DIR).files()
    print(
        f"rng states: {len(rng)} ranks   versions: "
        + ", ".join(f"{k} {v}" for k, v in versions.items() if v)
    )
    print(f"files: {len(files)}   bytes: {sum(f['size'] for f in files.values())}")
    print(f"state: {_state(store, ref, checksums=args.verify)}")
    return 0


def cmd_consolidate(args: argparse.Namespace) -> int:
    from raytrain_dt.checkpoint.export import write_hf

    store, ref = resolve(args.path)
    problems = store.problems(ref)
    if problems:
        raise CheckpointError("; ".join(problems))  # each names the step or its file
    files = write_hf(_tensor_source(ref), args.out, _hf_format(ref), int(args.shard_gb * 1e9))
    for f in files:
        print(f"{f}  {os.path.getsize(f)} bytes")
    return 0


def _tensor_source(ref: CheckpointRef):
    """The checkpoint's full model tensors, read by its engine's format."""
    engine = ref.train_state.get("engine", "fsdp2")
    if engine == "fsdp2":
        from raytrain_dt.checkpoint.export import DCPTensors

        return DCPTensors(ref.uri)
    if engine == "deepspeed":
        from raytrain_dt.engines.deepspeed_engine import TAG
        from raytrain_dt.engines.deepspeed_files import DeepSpeedTensors

        loc = Location.parse(ref.uri)
        if not loc.is_local:
            # DeepSpeed's reader opens its files with torch.load on a local path.
            raise CheckpointError(
                f"{ref.uri}: DeepSpeed checkpoints are consolidated from a local path"
            )
        return DeepSpeedTensors(Path(loc.path) / TAG)
    raise CheckpointError(f"{ref.uri}: engine {engine!r}: no reader for its files")


def _hf_format(ref: CheckpointRef):
    """Names and config.json: a preset's (renamed to the Hub's Llama), or a `model.hf` run's
    own config, rebuilt from the recorded source and overrides and checked against the shape
    the run recorded (a source directory changed since would write a config that lies)."""
    from raytrain_dt.checkpoint.export import hf_run_format, preset_format
    from raytrain_dt.models.hf_config import load_config, shape_of

    state = ref.train_state
    shape = ModelShape(**state["model_shape"])
    if not state.get("model_hf"):
        return preset_format(shape, state.get("seq_len", 2048))
    source, overrides = state["model_hf"], state.get("model_hf_config")
    if overrides is None:  # recorded before records held them: the run's config.yaml
        from raytrain_dt.tools.checkpoint_convert import run_config

        overrides = dict(run_config(ref, None).model.hf_config or {})
    built = shape_of(load_config(source, overrides))
    if built != shape:
        raise CheckpointError(
            f"{ref.uri}: model.hf={source} with model.hf_config={overrides} now gives shape "
            f"{built.__dict__}, the run trained {shape.__dict__}"
        )
    return hf_run_format(source, overrides)


def cmd_convert(args: argparse.Namespace) -> int:
    from raytrain_dt.tools.checkpoint_convert import convert, run_config

    _, ref = resolve(args.src)
    ref = convert(ref, args.dst, args.to, args.zero_stage, run_config(ref, args.config))
    layout = ref.train_state["layout"]
    print(f"{ref.uri}  engine={args.to} zero={layout['zero_stage']} step={ref.step} (committed)")
    return 0


def add_ckpt_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="ckpt_command", required=True)
    p = sub.add_parser("ls", help="list a run's checkpoints with their state")
    p.add_argument("run")
    p.set_defaults(func=cmd_ls)
    p = sub.add_parser("inspect", help="step, layout, engine, sizes, tensors, integrity")
    p.add_argument("path")
    p.add_argument(
        "--verify",
        action="store_true",
        help="read every file and check its SHA-256 against the commit record",
    )
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser(
        "consolidate",
        help="export any engine's checkpoint to Hugging Face safetensors + config.json",
    )
    p.add_argument("path", help="a run directory or a checkpoint directory")
    p.add_argument("--out", required=True)
    p.add_argument("--shard-gb", type=float, default=5.0, help="split the safetensors above this")
    p.set_defaults(func=cmd_consolidate)
    p = sub.add_parser("convert", help="rewrite a checkpoint for the other engine (1 rank)")
    p.add_argument("src", help="a run directory or a checkpoint directory")
    p.add_argument("dst", help="the checkpoints directory to write step_<N> into")
    p.add_argument("--to", required=True, choices=["fsdp2", "deepspeed"])
    p.add_argument(
        "--zero-stage",
        type=int,
        choices=[0, 1, 2, 3],
        default=None,
        help="ZeRO stage of the written checkpoint (default: the source's)",
    )
    p.add_argument(
        "--config",
        default=None,
        help="the run's config (default: config.yaml next to the checkpoints)",
    )
    p.set_defaults(func=cmd_convert)
