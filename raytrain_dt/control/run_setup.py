"""Run set-up shared by the coordinator, the API and the tests: the model shape, the dataset,
and the per-rank specs of a formation (the planned layout for a set of nodes comes from
`topology/run_plan.py`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from raytrain_dt.checkpoint.store import CheckpointRef
from raytrain_dt.config.schema import TrainConfig
from raytrain_dt.control.comm_env import forwarded_env
from raytrain_dt.data.input_pipeline import DataSlice
from raytrain_dt.data.prepare import prepare_dataset
from raytrain_dt.data.remote import is_remote
from raytrain_dt.data.source import TokenDataset
from raytrain_dt.models.model_spec import ModelSpec, model_spec
from raytrain_dt.models.presets import ModelShape
from raytrain_dt.topology.layout import Layout

# The driver's planning (also the simulator's, without Ray) lives in topology/run_plan.py; the
# coordinator and recovery import it through here with the rest of the run's set-up.
from raytrain_dt.topology.run_plan import (  # noqa: F401
    check_parallel_pins,
    choose_layout,
    plan_for_nodes,
    planned_checkpoint_bytes,
)
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
    stopped: bool = False  # stopped on request before the last step; run again to resume


def model_shape(cfg: TrainConfig) -> ModelShape:
    """The planner's facts about the configured model (preset or `model.hf`)."""
    return model_spec(cfg).shape


def uses_user_data(cfg: TrainConfig, dataset: object | None = None) -> bool:
    """Whether the run's samples come from a source still to be packed (needs Ray Data)."""
    return dataset is not None or bool(cfg.data.source)


def open_dataset(
    cfg: TrainConfig, dataset: object | None = None, tokenize=None, vocab_size: int | None = None
) -> TokenDataset:
    """The run's dataset; the default corpus is prepared on first use. A user source
    (`data.source`, or a Ray Dataset object) is packed into the run's cache first."""
    if uses_user_data(cfg, dataset):
        from raytrain_dt.data.user_data import open_user_dataset

        cache = Path(cfg.data.cache_dir or Path(cfg.run.dir) / "data_cache")
        # A source on S3 is read by Ray Data tasks, which get what the ranks get (and no more).
        env = forwarded_env(cfg.cluster.forward_env, os.environ)
        return open_user_dataset(cfg.data, cache, vocab_size, dataset, tokenize, env)
    path = cfg.data.path if is_remote(cfg.data.path) else Path(cfg.data.path)
    if _to_be_prepared(cfg):
        log.info(
            "dataset %s does not exist yet: preparing it from %s",
            path,
            cfg.data.text_glob or "the Python standard library sources",
        )
        prepare_dataset(path, cfg.data.text_glob, cfg.data.seq_len)
    return TokenDataset.open(path, cfg.data.seq_len)


def _to_be_prepared(cfg: TrainConfig) -> bool:
    """The default corpus, or a `data.text_glob` one, not prepared yet (done on first use)."""
    if is_remote(cfg.data.path):  # a prepared dataset on S3: never prepared here
        return False
    missing = not Path(cfg.data.path).exists()
    return missing and (cfg.data.path == DEFAULT_DATA_PATH or bool(cfg.data.text_glob))


def check_dataset(cfg: TrainConfig, dataset: object | None = None) -> None:
    """Before Ray starts: a token dataset that is there is opened (its metadata checked
    against the config); one that is neither there nor to be prepared is refused."""
    if not uses_user_data(cfg, dataset) and not _to_be_prepared(cfg):
        TokenDataset.open(cfg.data.path, cfg.data.seq_len)


def rank_specs(
    cfg: TrainConfig,
    shape: ModelShape,
    layout: Layout,
    dataset: TokenDataset,
    master: tuple[str, int],
    checkpoint_root: str,
    resume: CheckpointRef | None,
    model: ModelSpec | None = None,
) -> list[RankSpec]:
    start_step = resume.step if resume else 0
    consumed = resume.consumed_samples if resume else 0
    specs = []
    for rank in range(layout.dims.world_size):
        data = DataSlice(
            dataset=dataset,
            shuffle_seed=cfg.data.shuffle_seed,
            consumed_samples=consumed,
            num_steps=cfg.trainer.steps - start_step,
            global_batch=layout.global_batch,
            dp=layout.dims.dp,
            dp_rank=layout.dims.coords(rank).dp,
            micro_batch=layout.micro_batch,
            slots=layout.micro_batch * layout.grad_accum,
        )
        specs.append(
            RankSpec(
                rank=rank,
                layout=layout,
                master_addr=master[0],
                master_port=master[1],
                cfg=cfg,
                shape=shape,
                data=data,
                start_step=start_step,
                end_step=cfg.trainer.steps,
                checkpoint_root=checkpoint_root,
                resume_from=resume.path if resume else None,
                memory_resume=resume.record.get("memory") if resume else None,
                model=model,
            )
        )
    return specs
