"""`raytrain-dt doctor` on the shared simulated cluster (2 nodes x 2 accelerators).

On the emulated accelerator every check must pass, and what it measured must be right: the
all-reduce's sum was checked on the ranks, the training runs' losses (one across a killed
rank) equal the single-process reference, and the checkpoints it wrote are the size the disk
check assumed. Asked for CUDA on a cluster without GPUs, it must fail those checks, not pass.
"""

from __future__ import annotations

import json
import math

import pytest
from reference import reference_run
from torch.distributed.checkpoint import FileSystemReader

from raytrain_dt.checkpoint.store import CheckpointStore
from raytrain_dt.cli import main
from raytrain_dt.config.load import from_yaml
from raytrain_dt.models.model_spec import model_spec
from raytrain_dt.topology.host_memory import checkpoint_bytes


def _doctor(capsys, *argv: str) -> tuple[int, dict]:
    code = main(["doctor", "--json", *argv])
    return code, {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}


@pytest.mark.timeout(400)
def test_doctor_on_the_emulated_accelerator(ray_cluster, capsys, tmp_path):
    code, checks = _doctor(capsys, "--device", "emulated", "--work-dir", str(tmp_path))
    assert code == 0, [c for c in checks.values() if c["status"] != "PASS"]
    assert list(checks) == [
        "versions",
        "accelerators[emulated]",
        "all_reduce[emulated]",
        "train_step[fsdp2, emulated]",
        "reuse_after_killed_rank[emulated]",
        "train_step[deepspeed, emulated]",
        "host_memory",
        "disk",
    ]
    assert {c["status"] for c in checks.values()} == {"PASS"}, checks
    reduce = checks["all_reduce[emulated]"]["figures"]
    assert reduce["ranks"] == 2 and reduce["busbw_gbps"] > 0
    assert checks["reuse_after_killed_rank[emulated]"]["figures"]["kept"] == 1

    for engine in ("fsdp2", "deepspeed"):
        run_dir = tmp_path / f"emulated-{engine}"
        cfg = from_yaml((run_dir / "config.yaml").read_text())
        losses = checks[f"train_step[{engine}, emulated]"]["figures"]["losses"]
        assert losses == pytest.approx(reference_run(cfg, cfg.trainer.steps)[0], abs=1e-5)

    # The disk check's size model against the tensors FSDP2 really saved (DCP's metadata; the
    # files add a fixed per-tensor overhead that only a model this tiny notices).
    cfg = from_yaml((tmp_path / "emulated-fsdp2" / "config.yaml").read_text())
    ref = CheckpointStore(str(tmp_path / "emulated-fsdp2" / "checkpoints")).committed()[-1]
    metadata = FileSystemReader(ref.path).read_metadata().state_dict_metadata
    saved = sum(
        math.prod(m.size) * m.properties.dtype.itemsize
        for m in metadata.values()
        if hasattr(m, "size")
    )
    assert saved == pytest.approx(checkpoint_bytes(model_spec(cfg).shape, engine="fsdp2"), rel=1e-3)


def test_doctor_fails_cuda_on_a_cluster_without_gpus(ray_cluster, capsys, tmp_path):
    code, checks = _doctor(
        capsys, "--device", "cuda", "--work-dir", str(tmp_path), "cluster.host_memory_gb=0.5"
    )
    assert code == 1
    # Half a GB per node cannot hold even one rank process: the planner's one line, with the key.
    assert checks["host_memory"]["status"] == "FAIL"
    assert "cluster.host_memory_gb" in checks["host_memory"]["detail"]
    assert checks["accelerators[cuda]"]["status"] == "FAIL"
    assert checks["all_reduce[cuda]"]["status"] == "FAIL"
    assert "torch sees no CUDA device" in checks["all_reduce[cuda]"]["detail"]
    assert checks["train_step[fsdp2, cuda]"]["status"] == "FAIL"
    assert "the Ray cluster has no GPUs" in checks["train_step[fsdp2, cuda]"]["detail"]
