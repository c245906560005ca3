"""Engine conversion: a run saved under one engine continues under the other.

An uninterrupted 8-step run saves at step 4; `raytrain-dt ckpt convert` (in a subprocess, as a
user runs it) rewrites that checkpoint for the other engine into a fresh run directory, and the
resumed run's steps 5-8 equal the uninterrupted run's. The converted checkpoint is a 1-rank
one, so the resume at 2 ranks also exercises the target engine's own reshard path.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from report_checks import check_manifest

from raytrain_dt.control.coordinator import train
from raytrain_dt.observe.metrics import read_jsonl

pytestmark = pytest.mark.usefixtures("ray_cluster")

COMMON = ("trainer.steps=8", "checkpoint.every_steps=4", "engine.zero_stage=3")
ENGINE = {"fsdp2": ("engine.name=fsdp2",), "deepspeed": ("engine.name=deepspeed",)}


def ckpt_convert(src, dst, to: str) -> None:
    command = [sys.executable, "-m", "raytrain_dt.cli", "ckpt", "convert", str(src), str(dst)]
    done = subprocess.run([*command, "--to", to], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"engine={to}" in done.stdout


@pytest.mark.parametrize(
    ("source", "target"),
    [("fsdp2", "deepspeed"), ("deepspeed", "fsdp2")],
    ids=["fsdp2-to-deepspeed", "deepspeed-to-fsdp2"],
)
def test_converted_checkpoint_continues_exactly(make_config, tmp_path, source, target):
    first = tmp_path / "first"
    train(make_config(*COMMON, *ENGINE[source], run_dir=first), show_progress=False)
    uninterrupted = [m["loss"] for m in read_jsonl(first / "metrics.jsonl")]
    assert len(uninterrupted) == 8

    second = tmp_path / "second"
    ckpt_convert(first / "checkpoints" / "step_4", second / "checkpoints", target)
    # Hashed as it was written, every file: the converter is the one rank of both sides.
    record = check_manifest(str(second / "checkpoints" / "step_4"))
    assert record["train_state"]["engine"] == target
    assert record["train_state"]["consumed_samples"] == 4 * 8

    cfg = make_config(*COMMON, *ENGINE[target], "resume=true", run_dir=second)
    result = train(cfg, show_progress=False)
    assert result.final_step == 8 and result.layout.dims.dp == 2
    resumed = read_jsonl(second / "metrics.jsonl")
    assert [m["step"] for m in resumed] == [5, 6, 7, 8]
    assert [m["loss"] for m in resumed] == pytest.approx(uninterrupted[4:], abs=1e-5)
