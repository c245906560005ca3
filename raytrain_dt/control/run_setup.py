"""Run set-up shared by the coordinator, the API and the tests: the model shape, the dataset,
the planned layout for a set of nodes, and the per-rank specs of a formation.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path

from raytrain_dt.checkpoint.store import CheckpointRef
from raytrain_dt.config.schema import TrainConfig
from raytrain_dt.control.cluster import NodeInfo, planning_topology
from raytrain_dt.data.pipeline import DataSlice
from raytrain_dt.data.prepare import prepare_dataset
from raytrain_dt.data.source import TokenDataset
from raytrain_dt.errors import PlanningError
from raytrain_dt.models.presets import ModelShape, resolve_shape
from raytrain_dt.topology.layout import Layout, Topology
from raytrain_dt.topology.planner import LayoutPins, Plan, plan
from raytrain_dt.worker.device import resolve_precision
from raytrain_dt.worker.spec import RankSpec

log = logging.getLogger(__name__)

DEFAULT_DATA_PATH = "data/stdlib_tokens"


class TrainingFailed(RuntimeError):
    """The run could not go on; the message says why (errors grouped by rank)."""


@dataclass
class RunResult:
    run_dir: str
    final_step: int
    last_metrics: dict
    latest_checkpoint: str | None
    layout: Layout
    setup_timings: list[dict] = field(default_factory=list)


def model_shape(cfg: TrainConfig) -> ModelShape:
    m = cfg.model
    return resolve_shape(
        m.preset,
        dim=m.dim,
        n_layers=m.n_layers,
        n_heads=m.n_heads,
        n_kv_heads=m.n_kv_heads,
        vocab_size=m.vocab_size,
        ffn_hidden=m.ffn_hidden,
        tie_embeddings=m.tie_embeddings,
    )


def open_dataset(cfg: TrainConfig) -> TokenDataset:
    """The run's dataset; the default corpus is prepared on first use."""
    path = Path(cfg.data.path)
    if not path.exists() and (cfg.data.path == DEFAULT_DATA_PATH or cfg.data.text_glob):
        log.info(
            "dataset %s does not exist yet: preparing it from %s",
            path,
            cfg.data.text_glob or "the Python standard library sources",
        )
        prepare_dataset(path, cfg.data.text_glob, cfg.data.seq_len)
    return TokenDataset.open(path, cfg.data.seq_len)


def choose_layout(cfg: TrainConfig, shape: ModelShape, topology: Topology, on_gpu: bool) -> Plan:
    """Plan the layout for this cluster; whatever the config pins is honoured and validated."""
    pins = LayoutPins.from_config(cfg)
    if cfg.engine.name != "fsdp2" and pins.pp is None:
        # Only the FSDP2 engine runs pipeline stages, so no other engine may be planned onto one.
        pins = dataclasses.replace(pins, pp=1)
    return plan(
        shape,
        topology,
        global_batch=cfg.trainer.global_batch,
        seq_len=cfg.data.seq_len,
        pins=pins,
        precision=resolve_precision(cfg.engine.precision, on_gpu),
    )


def plan_for_nodes(cfg: TrainConfig, shape: ModelShape, resource: str,
                   nodes: tuple[NodeInfo, ...]) -> Plan | None:  # fmt: skip
    """The planner's answer for these nodes (None when nothing fits there)."""
    if not nodes:
        return None
    available = sum(n.accelerators for n in nodes)
    world = min(cfg.cluster.num_ranks or available, available)
    topology = planning_topology(cfg.cluster, resource, list(nodes), world)
    try:
        return choose_layout(cfg, shape, topology, resource == "GPU")
    except PlanningError as exc:
        log.warning("no layout on %d nodes: %s", len(nodes), exc)
        return None


def rank_specs(cfg: TrainConfig, shape: ModelShape, layout: Layout, dataset: TokenDataset,
               master: tuple[str, int], checkpoint_root: str,
               resume: CheckpointRef | None) -> list[RankSpec]:  # fmt: skip
    start_step = resume.step if resume else 0
    consumed = resume.consumed_samples if resume else 0
    specs = []
    for rank in range(layout.dims.world_size):
        data = DataSlice(
            dataset=dataset, shuffle_seed=cfg.data.shuffle_seed, consumed_samples=consumed,
            num_steps=cfg.trainer.steps - start_step, global_batch=layout.global_batch,
            dp=layout.dims.dp, dp_rank=layout.dims.coords(rank).dp, micro_batch=layout.micro_batch,
        )  # fmt: skip
        specs.append(RankSpec(
            rank=rank, layout=layout, master_addr=master[0], master_port=master[1], cfg=cfg,
            shape=shape, data=data, start_step=start_step, end_step=cfg.trainer.steps,
            checkpoint_root=checkpoint_root, resume_from=resume.path if resume else None,
        ))  # fmt: skip
    return specs
