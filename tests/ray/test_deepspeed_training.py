"""DeepSpeed ZeRO training on the shared local Ray cluster (also ZeRO-1 with pipeline stages),
checked against the single-process reference, plus resume from DeepSpeed's own checkpoints
(same layout, and at another DP size through a universal checkpoint)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from reference import reference_run
from report_checks import check_manifest

from raytrain_dt.control.coordinator import train
from raytrain_dt.observe.metrics import read_jsonl

pytestmark = pytest.mark.usefixtures("ray_cluster")


def checkpoint_params(step_dir: str) -> dict[str, torch.Tensor]:
    """fp32 master weights of a DeepSpeed checkpoint, consolidated in this process."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(step_dir, tag="ds")


@pytest.mark.parametrize(
    ("zero_stage", "offload"),
    [(1, False), (2, False), (3, False), (2, True)],
    ids=["zero1", "zero2", "zero3", "zero2-offload"],
)
def test_two_rank_deepspeed_equals_single_process(make_config, zero_stage, offload):
    # Offload: ZeRO-Offload keeps the fp32 master partition and steps it on the host with our
    # torch AdamW (`zero_force_ds_cpu_optimizer: false`), not the JIT-built DeepSpeedCPUAdam.
    cfg = make_config(
        "engine.name=deepspeed",
        f"engine.zero_stage={zero_stage}",
        f"engine.offload_optimizer={str(offload).lower()}",
        "trainer.grad_accum=2",
        "checkpoint.every_steps=5",
    )
    result = train(cfg, show_progress=False)
    assert result.layout.dims.dp == 2 and result.layout.grad_accum == 2
    assert result.layout.zero_stage == zero_stage
    assert result.layout.offload_optimizer == offload
    metrics = read_jsonl(f"{result.run_dir}/metrics.jsonl")
    ref_losses, ref_params = reference_run(cfg, cfg.trainer.steps)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    assert [m["loss"] for m in metrics] == pytest.approx(ref_losses, abs=1e-5)
    assert all(m["grad_norm"] > 0 for m in metrics)

    params = checkpoint_params(result.latest_checkpoint)
    assert params.keys() == ref_params.keys()
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name].float(), value, atol=1e-5, rtol=0)


def test_resume_equals_uninterrupted_and_reshards(make_config, tmp_path):
    run_dir = tmp_path / "resume"
    args = ("engine.name=deepspeed", "engine.zero_stage=2", "trainer.steps=6")
    args += ("checkpoint.every_steps=3",)
    train(make_config(*args, run_dir=run_dir), show_progress=False)
    uninterrupted = [m["loss"] for m in read_jsonl(run_dir / "metrics.jsonl")]
    assert len(uninterrupted) == 6
    # Each rank hashed what DeepSpeed wrote for it (rank 0 also its side files): all of it.
    record = check_manifest(str(run_dir / "checkpoints" / "step_3"))
    assert {
        "latest",
        "zero_to_fp32.py",
        "ds/mp_rank_00_model_states.pt",
        "ds/zero_pp_rank_1_mp_rank_00_optim_states.pt",
    } <= set(record["files"])

    # Same layout: lose everything after step 3, as a crash between the two saves would.
    shutil.rmtree(run_dir / "checkpoints" / "step_6")
    result = train(make_config(*args, "resume=true", run_dir=run_dir), show_progress=False)
    assert result.final_step == 6
    resumed = [m["loss"] for m in read_jsonl(run_dir / "metrics.jsonl")]
    assert resumed[3:] == pytest.approx(uninterrupted[3:], abs=1e-6)

    # One rank instead of two: DeepSpeed's loader refuses the 2-rank ZeRO checkpoint, so the
    # engine converts it to a universal one; the math must not notice.
    shutil.rmtree(run_dir / "checkpoints" / "step_6")
    one = make_config(*args, "resume=true", "cluster.num_ranks=1", run_dir=run_dir)
    result = train(one, show_progress=False)
    assert result.final_step == 6 and result.layout.dims.dp == 1
    resharded = [m["loss"] for m in read_jsonl(run_dir / "metrics.jsonl")]
    assert resharded[3:] == pytest.approx(uninterrupted[3:], abs=1e-5)


def test_zero1_pipeline_equals_single_process(make_config):
    """DeepSpeed ZeRO-1 over two pipeline stages through Ray (planned, placed, checkpointed)."""
    cfg = make_config(
        "engine.name=deepspeed",
        "parallel.pp=2",
        "trainer.grad_accum=2",
        "checkpoint.every_steps=5",
    )
    result = train(cfg, show_progress=False)
    assert (result.layout.dims.pp, result.layout.zero_stage) == (2, 1)
    metrics = read_jsonl(f"{result.run_dir}/metrics.jsonl")
    ref_losses, ref_params = reference_run(cfg, cfg.trainer.steps)
    assert [m["loss"] for m in metrics] == pytest.approx(ref_losses, abs=1e-5)
    # One set of DeepSpeed files per stage, each under the unsplit model's names.
    stages = sorted(Path(result.latest_checkpoint, "ds").glob("mp_rank_*_model_states.pt"))
    assert len(stages) == 2
    check_manifest(result.latest_checkpoint)  # each stage's files reported by its writer
    names = [set(torch.load(f, weights_only=False)["module"]) for f in stages]
    assert not names[0] & names[1] and names[0] | names[1] == ref_params.keys()
