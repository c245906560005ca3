"""Range and cross-field rules of the config: `validate()` raises one ConfigError naming the
key at fault (and the value), before anything starts. The schema (`schema.py`) holds the
fields and their defaults; this module only judges them.
"""

from __future__ import annotations

import re
from typing import Any

from raytrain_dt.config.schema import TrainConfig
from raytrain_dt.errors import ConfigError

CHOICES: dict[str, tuple[Any, ...]] = {
    "cluster.device": ("auto", "cpu", "cuda", "emulated"),
    "parallel.pp_schedule": ("gpipe", "1f1b", "interleaved"),
    "engine.name": ("fsdp2", "deepspeed"),
    "engine.zero_stage": (None, 0, 1, 2, 3),
    "engine.precision": ("auto", "fp32", "bf16"),
    "engine.grad_sync": ("auto", "final", "every"),
    "model.hf_init": ("auto", "random", "weights"),
    "data.format": ("auto", "parquet", "json", "text", "hf"),
    "comm.network": ("auto", "ib", "socket"),
    "comm.debug": ("VERSION", "WARN", "INFO", "TRACE"),
    "metrics.wandb.mode": (None, "online", "offline", "disabled"),
    "checkpoint.async_writer": ("process", "thread"),
}

# Accepted by the schema (the planner reasons about them) but not yet run by the engines.
_NOT_YET: dict[str, tuple[Any, ...]] = {
    "engine.name": ("fsdp2", "deepspeed"),
}

CHAOS_ACTIONS = (
    "kill_rank",
    "kill_node",
    "preempt_node",
    "add_node",
    "hang_rank",
    "kill_rank_mid_save",
)

POSITIVE = (
    "data.seq_len",
    "data.prefetch_batches",
    "trainer.steps",
    "trainer.global_batch",
    "trainer.micro_batch",
    "trainer.grad_accum",
    "trainer.log_every",
    "parallel.tp",
    "parallel.pp",
    "parallel.dp_replicate",
    "parallel.dp_shard",
    "parallel.virtual_stages",
    "parallel.cp",
    "parallel.ep",
    "cluster.local_nodes",
    "cluster.accelerators_per_node",
    "cluster.num_ranks",
    "cluster.cpus_per_rank",
    "cluster.data_cpus_per_rank",
    "cluster.memory_per_accelerator_gb",
    "cluster.peak_tflops",
    "cluster.placement_timeout_s",
    "cluster.host_memory_gb",
    "elastic.min_nodes",
    "elastic.max_nodes",
    "elastic.max_failures_at_step",
    "elastic.wait_timeout_s",
    "elastic.hang_timeout_s",
    "elastic.formation_timeout_s",
    "checkpoint.assumed_write_gbps",
    "checkpoint.keep_last",
    "model.dim",
    "model.n_layers",
    "model.n_heads",
    "model.n_kv_heads",
    "model.vocab_size",
    "model.ffn_hidden",
    "model.experts_per_token",
    "comm.timeout_s",
    "comm.buffsize_bytes",
)

NON_NEGATIVE = (
    "trainer.lr",
    "trainer.warmup_steps",
    "trainer.weight_decay",
    "trainer.grad_clip",
    "checkpoint.every_steps",
    "checkpoint.keep_every",
    "checkpoint.memory_every_steps",
    "elastic.max_restarts",
    "elastic.grow_stable_s",
    "cluster.keep_warm_s",
    "comm.trace_buffer",
    "model.n_experts",
    "model.moe_ffn_hidden",
    "model.capacity_factor",
    "model.router_aux_loss_coef",
)


# What a process environment variable may be called (the POSIX portable set).
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _get(cfg: TrainConfig, dotted: str) -> Any:
    value: Any = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def validate(cfg: TrainConfig) -> TrainConfig:
    """Range and cross-field checks; raises ConfigError naming the key at fault."""
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, allowed))}")
    for key in POSITIVE:
        value = _get(cfg, key)
        if value is not None and value <= 0:
            raise ConfigError(f"{key}: must be > 0, got {value}")
    for key in NON_NEGATIVE:
        value = _get(cfg, key)
        if value is not None and value < 0:
            raise ConfigError(f"{key}: must be >= 0, got {value}")
    t = cfg.trainer
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise ConfigError(f"trainer.min_lr_ratio: must be in [0, 1], got {t.min_lr_ratio}")
    for key in ("trainer.beta1", "trainer.beta2"):
        if not 0.0 <= _get(cfg, key) < 1.0:
            raise ConfigError(f"{key}: must be in [0, 1), got {_get(cfg, key)}")
    if not 0.0 <= t.batch_tolerance < 1.0:
        raise ConfigError(f"trainer.batch_tolerance: must be in [0, 1), got {t.batch_tolerance}")
    if t.warmup_steps > t.steps:
        raise ConfigError(f"trainer.warmup_steps: {t.warmup_steps} exceeds trainer.steps={t.steps}")
    if t.micro_batch and t.grad_accum and t.global_batch % (t.micro_batch * t.grad_accum):
        raise ConfigError(
            f"trainer.global_batch: {t.global_batch} is not a multiple of "
            f"trainer.micro_batch x trainer.grad_accum = {t.micro_batch * t.grad_accum}"
        )
    for key, supported in _NOT_YET.items():
        if _get(cfg, key) not in supported:
            raise ConfigError(f"{key}: {_get(cfg, key)!r} is not supported by this version yet")
    for i, action in enumerate(cfg.chaos):
        if action.action not in CHAOS_ACTIONS:
            raise ConfigError(
                f"chaos[{i}].action: {action.action!r} is not one of {', '.join(CHAOS_ACTIONS)}"
            )
        if action.at_step < 1:
            raise ConfigError(f"chaos[{i}].at_step: must be >= 1, got {action.at_step}")
        if action.at not in ("step", "forming", "joined"):
            raise ConfigError(f"chaos[{i}].at: {action.at!r} is not one of step, forming, joined")
        if action.at == "forming" and action.action not in ("kill_node", "kill_rank"):
            raise ConfigError(
                f"chaos[{i}].at: forming fires only kill_node or kill_rank, not {action.action}"
            )
        if action.at == "joined" and action.action != "kill_rank":
            raise ConfigError(f"chaos[{i}].at: joined fires only kill_rank, not {action.action}")
        if action.action == "kill_rank_mid_save" and cfg.engine.name != "fsdp2":
            # Only FSDP2's DCP writer can be interrupted midway (Engine.supports_async_save).
            raise ConfigError(
                f"chaos[{i}].action: kill_rank_mid_save needs engine.name=fsdp2 "
                f"({cfg.engine.name} writes its own checkpoint files)"
            )
    if cfg.chaos_step_delay_s < 0:
        raise ConfigError(f"chaos_step_delay_s: must be >= 0, got {cfg.chaos_step_delay_s}")
    if cfg.model.init_from and cfg.model.hf:
        raise ConfigError("model.init_from: not with model.hf (whose directory has the weights)")
    e = cfg.elastic
    if e.hang_step_multiple < 1:
        raise ConfigError(f"elastic.hang_step_multiple: must be >= 1, got {e.hang_step_multiple}")
    if e.max_nodes is not None and e.max_nodes < e.min_nodes:
        raise ConfigError(f"elastic.max_nodes: {e.max_nodes} < elastic.min_nodes={e.min_nodes}")
    par = cfg.parallel
    if par.pp_layers is not None:
        if not par.pp_layers or any(n < 1 for n in par.pp_layers):
            raise ConfigError(
                f"parallel.pp_layers: every stage needs >= 1 layer, got {par.pp_layers}"
            )
        if par.pp is not None and len(par.pp_layers) != par.pp * par.virtual_stages:
            raise ConfigError(
                f"parallel.pp_layers: {len(par.pp_layers)} stages, but parallel.pp={par.pp} x "
                f"parallel.virtual_stages={par.virtual_stages} = {par.pp * par.virtual_stages}"
            )
        if len(par.pp_layers) % par.virtual_stages:
            raise ConfigError(
                f"parallel.pp_layers: {len(par.pp_layers)} stages is not a multiple of "
                f"parallel.virtual_stages={par.virtual_stages}"
            )
    if cfg.data.seq_len < 2:
        raise ConfigError(f"data.seq_len: must be >= 2, got {cfg.data.seq_len}")
    if par.cp and cfg.data.seq_len % (2 * par.cp):
        raise ConfigError(
            f"parallel.cp: {par.cp} does not split data.seq_len={cfg.data.seq_len} into "
            f"2 x cp = {2 * par.cp} equal chunks"
        )
    for name in cfg.cluster.forward_env:
        if not ENV_NAME.fullmatch(name):
            raise ConfigError(
                f"cluster.forward_env: {name!r} is not a valid environment variable name"
            )
    for name in cfg.comm.env:
        if not ENV_NAME.fullmatch(name):
            raise ConfigError(f"comm.env.{name}: not a valid environment variable name")
    for key in (
        "metrics.mlflow.tracking_uri",
        "metrics.mlflow.experiment",
        "metrics.wandb.project",
    ):
        if _get(cfg, key) == "":
            raise ConfigError(f"{key}: must not be empty")
    return cfg
