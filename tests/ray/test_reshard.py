"""Continuity across layouts: a checkpoint written at one layout resumes at another, and the
next steps' losses equal those of the uninterrupted run at the first layout.

Each source layout trains once, uninterrupted, for 8 steps with a save at step 4 (module-scoped,
shared by the cases that start from it). A case copies that run's step_4 checkpoint into a
fresh run directory and resumes it at the target layout. trainer.steps stays 8 in both, since
the LR schedule depends on it. FSDP2 reshards through DCP; DeepSpeed ZeRO-2 dp=2 -> dp=1 is
covered in test_deepspeed_training.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from raytrain_dt.config import load_config
from raytrain_dt.control.coordinator import train
from raytrain_dt.observe.metrics import read_jsonl

pytestmark = pytest.mark.usefixtures("ray_cluster")

REPO = Path(__file__).resolve().parents[2]
COMMON = ("trainer.steps=8", "checkpoint.every_steps=4")

# Source layouts: overrides on conf/test.yaml (which pins cluster.num_ranks=2).
LAYOUTS = {
    "dp4-full": ("cluster.num_ranks=4", "parallel.dp_shard=4", "engine.zero_stage=3"),
    "dp2-full": ("cluster.num_ranks=2", "engine.zero_stage=3"),
    "dp2xtp2": ("cluster.num_ranks=4", "parallel.tp=2", "engine.zero_stage=3"),
    "dp4-tp1": (
        "cluster.num_ranks=4",
        "parallel.tp=1",
        "parallel.dp_shard=4",
        "engine.zero_stage=3",
    ),
    "hsdp2x2": (
        "cluster.num_ranks=4",
        "parallel.dp_replicate=2",
        "parallel.dp_shard=2",
        "engine.zero_stage=3",
    ),
    "pp2": ("cluster.num_ranks=2", "parallel.pp=2"),
    "pp1-dp2": ("cluster.num_ranks=2", "parallel.pp=1", "engine.zero_stage=3"),
}


@pytest.fixture(scope="module")
def uninterrupted(token_data, tmp_path_factory):
    """layout name -> (run dir, losses of its 8 steps); each source layout trains once."""
    runs: dict[str, tuple[Path, list[float]]] = {}

    def get(name: str) -> tuple[Path, list[float]]:
        if name not in runs:
            run_dir = tmp_path_factory.mktemp(f"src-{name}")
            train(config(token_data, run_dir, *LAYOUTS[name]), show_progress=False)
            runs[name] = (run_dir, [m["loss"] for m in read_jsonl(run_dir / "metrics.jsonl")])
        return runs[name]

    return get


def config(token_data: Path, run_dir: Path, *overrides: str):
    return load_config(
        REPO / "conf" / "test.yaml",
        [f"data.path={token_data}", f"run.dir={run_dir}", *COMMON, *overrides],
    )


@pytest.mark.parametrize(
    ("source", "target"),
    [
        ("dp4-full", "dp2-full"),
        ("dp2xtp2", "dp4-tp1"),
        ("dp4-full", "hsdp2x2"),
        ("hsdp2x2", "dp4-full"),
        ("pp2", "pp1-dp2"),
    ],
)
def test_resume_at_another_layout_continues_exactly(
    uninterrupted, token_data, tmp_path, source, target
):
    source_dir, losses = uninterrupted(source)
    assert len(losses) == 8
    run_dir = tmp_path / "resumed"
    shutil.copytree(source_dir / "checkpoints" / "step_4", run_dir / "checkpoints" / "step_4")
    cfg = config(token_data, run_dir, *LAYOUTS[target], "resume=true")
    result = train(cfg, show_progress=False)
    assert result.final_step == 8
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [5, 6, 7, 8]
    assert [m["loss"] for m in metrics] == pytest.approx(losses[4:], abs=1e-5)
    # The target layout is what actually ran, and it differs from the source's.
    assert result.layout.as_dict() != source_layout(source_dir)


def source_layout(run_dir: Path) -> dict:
    record = json.loads((run_dir / "checkpoints" / "step_4" / "commit.json").read_text())
    return record["train_state"]["layout"]
