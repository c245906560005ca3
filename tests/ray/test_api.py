"""One run three ways: the Python API (`Trainer` with a model spec and a Ray Dataset object),
`raytrain-dt train` with `data.source`, and the `jobs/pretrain.py` entry point joining the
session cluster through RAY_ADDRESS. All three train the same packed samples with the same
model, so their losses are the same.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

from raytrain_dt import Result, Trainer
from raytrain_dt.cli import main
from raytrain_dt.config import load_config
from raytrain_dt.models.model_spec import model_spec
from raytrain_dt.observe.metrics import read_jsonl

pytestmark = pytest.mark.usefixtures("ray_cluster")
REPO = Path(__file__).resolve().parents[2]
STEPS = 2


def _overrides(tmp_path: Path, name: str) -> list[str]:
    # Only the API run saves (its Result names the checkpoint); the others need only losses.
    every = STEPS if name == "api" else 0
    return [
        f"run.dir={tmp_path / name}",
        f"trainer.steps={STEPS}",
        f"checkpoint.every_steps={every}",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]


def _losses(run_dir: Path) -> list[float]:
    return [m["loss"] for m in read_jsonl(run_dir / "metrics.jsonl")]


# Three complete runs, each starting its own rank actors.
@pytest.mark.timeout(600)
def test_python_api_cli_and_job_train_the_same(ray_cluster, user_docs, tmp_path, monkeypatch):
    import ray.data

    recipe = str(REPO / "conf" / "test.yaml")
    jsonl = str(user_docs / "docs.jsonl")
    api_overrides = _overrides(tmp_path, "api")
    spec = model_spec(load_config(recipe, api_overrides))
    result = Trainer(
        recipe, api_overrides, model=spec, dataset=ray.data.read_json(jsonl), show_progress=False
    ).fit()
    assert isinstance(result, Result)
    assert result.final_step == STEPS and result.metrics["step"] == STEPS
    assert result.checkpoint is not None and Path(result.checkpoint, "commit.json").is_file()
    assert any(e["event"] == "start" for e in read_jsonl(result.events_path))

    cli_overrides = [*_overrides(tmp_path, "cli"), f"data.source={jsonl}"]
    assert main(["train", recipe, *cli_overrides]) == 0

    # The job's entry point as `ray job submit` runs it (RAY_ADDRESS set, argv from the
    # command line), in this process: a second driver would pay torch's import and new rank
    # actors again. tests/ray/test_job_submit.py covers the real `ray job submit`.
    job_overrides = [*_overrides(tmp_path, "job"), f"data.source={jsonl}"]
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster.address)
    monkeypatch.setattr(sys, "argv", ["pretrain.py", recipe, *job_overrides])
    with pytest.raises(SystemExit) as job:
        runpy.run_path(str(REPO / "jobs" / "pretrain.py"), run_name="__main__")
    assert job.value.code == 0

    api = _losses(result.run_dir)
    assert len(api) == STEPS
    assert _losses(tmp_path / "cli") == pytest.approx(api, abs=1e-6)
    assert _losses(tmp_path / "job") == pytest.approx(api, abs=1e-6)
