"""The coordinator: the driver-side control plane of one training run.

It prepares the run directory and data, connects to Ray, decides the layout, starts the rank
group, watches it (progress, metrics, ledger, failures), and tears it down. It never imports
torch.distributed: everything it knows about ranks comes from their reports.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from raytrain_dt.checkpoint.store import CheckpointRef, CheckpointStore
from raytrain_dt.config.load import to_yaml
from raytrain_dt.config.schema import TrainConfig
from raytrain_dt.control.checkpoint_tracker import CheckpointTracker
from raytrain_dt.control.cluster import (
    ClusterHandle,
    NodeInfo,
    alive_nodes,
    connect,
    planning_topology,
)
from raytrain_dt.control.rank_group import RankGroup
from raytrain_dt.data.pipeline import DataSlice
from raytrain_dt.data.prepare import prepare_dataset
from raytrain_dt.data.source import TokenDataset
from raytrain_dt.errors import ConfigError, UserError
from raytrain_dt.models.presets import ModelShape, resolve_shape
from raytrain_dt.observe.logs import setup_driver_logging
from raytrain_dt.observe.metrics import RunRecorder
from raytrain_dt.topology.layout import Layout, Topology
from raytrain_dt.topology.planner import LayoutPins, Plan, plan
from raytrain_dt.worker.device import resolve_precision
from raytrain_dt.worker.spec import RankSpec

log = logging.getLogger(__name__)

DEFAULT_DATA_PATH = "data/stdlib_tokens"
POLL_INTERVAL_S = 0.1


class TrainingFailed(RuntimeError):
    """One or more ranks failed; the message groups the errors by rank."""


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


class Coordinator:
    def __init__(
        self, cfg: TrainConfig, ray_temp_dir: str | None = None, show_progress: bool = True
    ):
        self.cfg = cfg
        self.run_dir = Path(cfg.run.dir).resolve()
        self.checkpoint_root = cfg.checkpoint.dir or str(self.run_dir / "checkpoints")
        self.store = CheckpointStore(self.checkpoint_root)
        self.ray_temp_dir = ray_temp_dir
        self.show_progress = show_progress
        self.shape = model_shape(cfg)

    # --- before any actor starts: everything that can be wrong with the input ----------------
    def _prepare(self) -> tuple[TokenDataset, CheckpointRef | None]:
        existing = self.store.committed()
        if existing and not self.cfg.resume:
            raise UserError(
                f"run.dir: {self.run_dir} already has checkpoints (latest step "
                f"{existing[-1].step}); pass resume=true to continue it or choose another run.dir"
            )
        dataset = open_dataset(self.cfg)
        if self.shape.vocab_size < 256:
            raise ConfigError(f"model.vocab_size: {self.shape.vocab_size} < 256 byte tokens")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(to_yaml(self.cfg))
        resume = self.store.latest_valid() if self.cfg.resume else None
        if self.cfg.resume and resume is None:
            log.info("resume=true but %s holds no committed checkpoint: starting fresh",
                     self.checkpoint_root)  # fmt: skip
        return dataset, resume

    def _world_size(self, handle: ClusterHandle) -> tuple[int, list[NodeInfo]]:
        nodes = alive_nodes(handle.accelerator_resource)
        available = sum(n.accelerators for n in nodes)
        wanted = self.cfg.cluster.num_ranks or available
        if wanted > available:
            raise UserError(
                f"cluster.num_ranks: {wanted} ranks requested but the cluster has {available} "
                f"'{handle.accelerator_resource}' on {len(nodes)} nodes"
            )
        return wanted, nodes

    def _rank_specs(
        self, group: RankGroup, layout: Layout, dataset: TokenDataset, resume: CheckpointRef | None
    ) -> list[RankSpec]:
        start_step = resume.step if resume else 0
        consumed = resume.consumed_samples if resume else 0
        addr, port = group.master
        specs = []
        for rank in range(layout.dims.world_size):
            data = DataSlice(
                dataset=dataset,
                shuffle_seed=self.cfg.data.shuffle_seed,
                consumed_samples=consumed,
                num_steps=self.cfg.trainer.steps - start_step,
                global_batch=layout.global_batch,
                dp=layout.dims.dp,
                dp_rank=layout.dims.coords(rank).dp,
                micro_batch=layout.micro_batch,
            )
            specs.append(
                RankSpec(
                    rank=rank,
                    layout=layout,
                    master_addr=addr,
                    master_port=port,
                    cfg=self.cfg,
                    shape=self.shape,
                    data=data,
                    start_step=start_step,
                    end_step=self.cfg.trainer.steps,
                    checkpoint_root=str(self.checkpoint_root),
                    resume_from=resume.path if resume else None,
                )
            )
        return specs

    # --- the run -----------------------------------------------------------------------------
    def run(self) -> RunResult:
        dataset, resume = self._prepare()
        handler = setup_driver_logging(self.run_dir)
        try:
            with connect(self.cfg.cluster, self.ray_temp_dir) as handle:
                return self._train(handle, dataset, resume)
        finally:
            logging.getLogger("raytrain_dt").removeHandler(handler)
            handler.close()

    def _train(
        self, handle: ClusterHandle, dataset: TokenDataset, resume: CheckpointRef | None
    ) -> RunResult:
        world_size, nodes = self._world_size(handle)
        topology = planning_topology(
            self.cfg.cluster, handle.accelerator_resource, nodes, world_size
        )
        planned = choose_layout(
            self.cfg, self.shape, topology, handle.accelerator_resource == "GPU"
        )
        layout = planned.best.layout
        (self.run_dir / "plan.json").write_text(json.dumps(planned.to_json(), indent=2))
        (self.run_dir / "layout.json").write_text(json.dumps(layout.as_dict(), indent=2))
        log.info(
            "layout: %s on %d ranks (%s): %s; run dir %s",
            layout.describe(),
            layout.dims.world_size,
            handle.mode,
            planned.best.reason,
            self.run_dir,
        )
        recorder = RunRecorder(self.run_dir, resume.step if resume else 0)
        recorder.event(
            "start", layout=layout.as_dict(), resumed_from=resume.path if resume else None
        )
        group = RankGroup(
            str(self.run_dir), handle.accelerator_resource, self.cfg.cluster.cpus_per_rank
        )
        try:
            group.start(
                layout.dims.world_size,
                [n.accelerators for n in nodes],
                layout.dims.tp,
                self.cfg.cluster.placement_timeout_s,
            )
            recorder.event("placed", node_ids=[p["node_id"] for p in group.placement])
            specs = self._rank_specs(group, layout, dataset, resume)
            timings = group.call("setup", [(s,) for s in specs])
            group.call("start")
            final_step = self._monitor(group, layout, recorder, resume.step if resume else 0)
            recorder.event("finish", step=final_step)
        finally:
            group.shutdown()
            recorder.close()
        committed = self.store.committed()
        latest = committed[-1] if committed else None
        return RunResult(
            str(self.run_dir),
            final_step,
            recorder.last_metrics,
            latest.path if latest else None,
            layout,
            timings,
        )

    def _monitor(
        self, group: RankGroup, layout: Layout, recorder: RunRecorder, start_step: int
    ) -> int:
        steps = self.cfg.trainer.steps
        dp_of = [layout.dims.coords(r).dp for r in range(layout.dims.world_size)]
        step = start_step
        checkpoints = CheckpointTracker(
            self.store,
            layout.dims.world_size,
            recorder,
            self.cfg.checkpoint.keep_last,
            self.cfg.checkpoint.keep_every,
        )
        bar = tqdm(
            total=steps,
            initial=start_step,
            desc="train",
            unit="step",
            disable=not self.show_progress,
            dynamic_ncols=True,
        )
        try:
            while True:
                statuses = group.poll()
                for status in statuses:
                    for report in status["reports"]:
                        if report["kind"] == "step":
                            if "sample_ids" in report:
                                recorder.step_samples(
                                    report["step"],
                                    dp_of[status["rank"]],
                                    layout.dims.dp,
                                    report["sample_ids"],
                                )
                            if "loss" in report:
                                recorder.step_metrics(
                                    report, layout.dims.world_size, layout.describe()
                                )
                                bar.update(report["step"] - step)
                                step = report["step"]
                                bar.set_postfix(
                                    loss=f"{report['loss']:.4f}",
                                    tok_s=f"{report['tokens_per_s']:.0f}",
                                )
                        else:
                            checkpoints.on_report(report)
                failed = [s for s in statuses if s["state"] == "failed"]
                if failed:
                    recorder.event("failed", ranks=[s["rank"] for s in failed])
                    raise TrainingFailed(_group_errors(failed))
                if all(s["state"] == "done" for s in statuses):
                    return step
                time.sleep(POLL_INTERVAL_S)
        finally:
            bar.close()


def _group_errors(failed: list[dict]) -> str:
    """One block per distinct error, listing the ranks that hit it."""
    by_error: dict[str, list[int]] = {}
    for status in failed:
        by_error.setdefault(status["error"].strip(), []).append(status["rank"])
    return "\n".join(f"ranks {ranks}:\n{error}" for error, ranks in by_error.items())


def train(cfg: TrainConfig, **kwargs) -> RunResult:
    return Coordinator(cfg, **kwargs).run()


def replace_config(cfg: TrainConfig, **sections) -> TrainConfig:
    """A copy of cfg with some fields of some sections replaced (tests, API)."""
    changes = {
        name: dataclasses.replace(getattr(cfg, name), **fields) for name, fields in sections.items()
    }
    return dataclasses.replace(cfg, **changes)
