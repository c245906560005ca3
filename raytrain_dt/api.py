"""The Python API: `Trainer(config, model=..., dataset=..., tokenize=...).fit() -> Result`.

The same run `raytrain-dt train` and `jobs/pretrain.py` start, from Python objects: the typed
config (a `TrainConfig`, or a recipe path plus dotlist overrides), a model spec
(`raytrain_dt.models.model_spec.ModelSpec`; default: what `model.*` names), and the data as a Ray
Dataset or a path (default: `data.*`), with an optional tokenize map. Everything planning,
elasticity, exactly-once data and checkpoints do applies unchanged: `fit` runs the coordinator.
docs/migrating-from-ray-train.md maps Ray Train's TorchTrainer onto this.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytrain_dt.config.load import load_config
from raytrain_dt.config.schema import TrainConfig
from raytrain_dt.config.validation import validate
from raytrain_dt.models.model_spec import ModelSpec
from raytrain_dt.topology.layout import Layout


@dataclass(frozen=True)
class Result:
    """What a finished run leaves: final metrics, where it went, its latest checkpoint."""

    metrics: dict
    run_dir: Path
    # The latest committed checkpoint (None when the run saved none).
    checkpoint: str | None
    final_step: int
    layout: Layout

    @property
    def events_path(self) -> Path:
        return self.run_dir / "events.jsonl"

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    @property
    def ledger_path(self) -> Path:
        return self.run_dir / "ledger.jsonl"


class Trainer:
    """One training run, configured in Python; `fit()` runs it to the end."""

    def __init__(
        self,
        config: TrainConfig | str | Path | None = None,
        overrides: list[str] | None = None,
        *,
        model: ModelSpec | None = None,
        dataset: Any = None,
        tokenize: Callable | None = None,
        show_progress: bool = True,
    ):
        """config: a TrainConfig, or a recipe path (None: the schema defaults) with `overrides`
        (dotlist, as on the command line). model: a ModelSpec (default: `model.*`). dataset: a
        Ray Dataset, or a path/glob of parquet, JSONL, text files or a `datasets` directory
        (default: `data.*`); it is tokenized (`tokenize`, a Ray Data map over pyarrow batches
        returning a `tokens` list column, or `data.tokenizer`) and packed into seq_len rows."""
        if isinstance(config, TrainConfig):
            if overrides:
                raise ValueError("overrides: apply them to the TrainConfig, or pass a recipe path")
            cfg = dataclasses.replace(config)
        else:
            cfg = load_config(config, overrides)
        if isinstance(dataset, str | Path):
            cfg.data = dataclasses.replace(cfg.data, source=str(dataset))
            dataset = None
        self.cfg = validate(cfg)
        self.model = model
        self.dataset = dataset
        self.tokenize = tokenize
        self.show_progress = show_progress

    def fit(self) -> Result:
        from raytrain_dt.control.coordinator import train

        run = train(
            self.cfg,
            show_progress=self.show_progress,
            model=self.model,
            dataset=self.dataset,
            tokenize=self.tokenize,
        )
        return Result(
            metrics=dict(run.last_metrics),
            run_dir=Path(run.run_dir),
            checkpoint=run.latest_checkpoint,
            final_step=run.final_step,
            layout=run.layout,
        )
