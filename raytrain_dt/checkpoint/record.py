"""What a checkpoint says about itself, and whether it fits a model.

`train_state_record` is the metadata rank 0 hands the coordinator with every save; it becomes
the commit record's `train_state`: the train state (step, samples, tokens), the LR schedule and
the LR at that step, where the RNG states are, the layout and engine that wrote it (degrees,
world size), the model (preset, shape, every tensor's shape) and the versions.

`check_fits` compares a checkpoint's tensor shapes with a model's before anything loads: one
`CheckpointError` lists every tensor that differs, with both shapes. The driver runs it on the
commit record before any actor starts; the FSDP2 engine runs it on DCP's metadata too.
"""

from __future__ import annotations

import functools
import platform
import time
from importlib import metadata

from raytrain_dt.errors import CheckpointError

RNG_DIR = "rng"  # rng/rank_<r>.pt: each rank's torch RNG state


def tensor_shapes(state_dict: dict) -> dict[str, list[int]]:
    """Name -> global shape of every tensor of an (unsharded or meta) model's state dict."""
    return {name: list(t.shape) for name, t in state_dict.items() if hasattr(t, "shape")}


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def versions() -> dict[str, str | None]:
    return {
        "python": platform.python_version(),
        **{p: _version(p) for p in ("raytrain_dt", "torch", "ray", "deepspeed")},
    }


def train_state_record(
    spec, step: int, consumed: int, tensors: dict[str, list[int]], next_lr: float
) -> dict:
    """The commit record's `train_state` for a save after `step` steps (`spec`: the rank's
    RankSpec; `tensors`: `tensor_shapes` of the unsharded model; `next_lr`: the schedule's LR
    of step `step`, the next one to run, computed by the engines' schedule)."""
    cfg, layout = spec.cfg, spec.layout
    t = cfg.trainer
    schedule = {
        "lr": t.lr,
        "warmup_steps": t.warmup_steps,
        "total_steps": t.steps,
        "min_lr_ratio": t.min_lr_ratio,
    }
    return {
        "step": step,
        "consumed_samples": consumed,
        "tokens": consumed * cfg.data.seq_len,
        "global_batch": layout.global_batch,
        # The schedule is a pure function of the step (engines/schedule.py `lr_at`): these
        # settings and the step are its whole state.
        "lr_scheduler": {"kind": "warmup_cosine", **schedule, "next_lr": next_lr},
        "rng": {
            "kind": "torch.get_rng_state + accelerator get_rng_state",
            "files": f"{RNG_DIR}/rank_<r>.pt",
            "seed": cfg.run.seed,
        },
        "layout": layout.as_dict(),
        "world_size": layout.dims.world_size,
        "engine": cfg.engine.name,
        "model_preset": None if cfg.model.hf else cfg.model.preset,
        "model_hf": cfg.model.hf,
        # With the source, what `ckpt consolidate` rebuilds the run's HF config from.
        "model_hf_config": dict(cfg.model.hf_config or {}),
        "model_shape": spec.shape.__dict__,
        "tensors": tensors,
        "seq_len": cfg.data.seq_len,
        "versions": (found := versions()),
        "torch_version": found["torch"],
        "saved_at": time.time(),
    }


def check_fits(checkpoint: str, saved: dict[str, list[int]], model: dict[str, list[int]]) -> None:
    """CheckpointError listing every tensor whose shape differs (or that only one side has)."""
    differences = []
    for name in sorted(set(saved) | set(model)):
        ours, theirs = model.get(name), saved.get(name)
        if ours is not None and theirs is not None and list(ours) == list(theirs):
            continue
        shown = [("absent" if s is None else tuple(s)) for s in (theirs, ours)]
        differences.append(f"{name} checkpoint {shown[0]} vs model {shown[1]}")
    if differences:
        raise CheckpointError(
            f"{checkpoint}: does not fit the model, {len(differences)} tensors differ: "
            + "; ".join(differences)
        )


def check_resume_fits(ref, model_spec, seq_len: int) -> None:
    """Before a run resumes from `ref` (a CheckpointRef): its recorded tensor shapes against
    the configured model's, built on the meta device (no memory)."""
    saved = ref.train_state.get("tensors")
    if saved is None:  # recorded before records held shapes; the engine's load still checks
        return
    model = model_spec.build(seq_len, seed=0, device="meta")
    check_fits(ref.uri, saved, tensor_shapes(model.state_dict()))
