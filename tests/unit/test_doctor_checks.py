"""`raytrain-dt doctor`'s pure parts: which devices it checks, the disk check, and how results
are shown. (The checkpoint size it assumes is held against a real checkpoint in
tests/ray/test_doctor.py.)"""

from __future__ import annotations

import json
import shutil

from raytrain_dt.doctor.checks import check_disk
from raytrain_dt.doctor.doctor_cli import devices_to_check
from raytrain_dt.doctor.result import FAIL, PASS, SKIP, Check, format_json, format_table


def test_a_cpu_cluster_is_checked_on_cpu_and_emulated_a_gpu_cluster_on_cuda():
    assert devices_to_check(None, cluster_gpus=0) == ["cpu", "emulated"]
    assert devices_to_check(None, cluster_gpus=16) == ["cuda"]
    assert devices_to_check(["emulated", "emulated", "cpu"], 16) == ["emulated", "cpu"]


def test_disk_fails_when_the_kept_checkpoints_do_not_fit(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    # keep_last=2 plus the one being written: three checkpoints must fit.
    small = check_disk(str(tmp_path / "not" / "yet" / "made"), free / 4, keep=2)
    assert small.status == PASS and small.figures["need_bytes"] == free / 4 * 3
    big = check_disk(str(tmp_path), free / 2, keep=2)
    assert big.status == FAIL
    assert "checkpoint.dir" in big.detail and "checkpoint.keep_last" in big.detail


def test_remote_checkpoints_need_no_local_disk():
    check = check_disk("s3://bucket/run/checkpoints", 1e15, keep=3)
    assert check.status == PASS and check.figures["need_bytes"] == 4e15


def test_results_print_one_line_each_and_valid_json():
    checks = [
        Check("versions", PASS, "torch 2.13"),
        Check("all_reduce[cuda]", FAIL, "timed out", {"busbw_gbps": 0.0}),
        Check("reuse_after_killed_rank[cuda]", SKIP, "needs two accelerators"),
    ]
    table = format_table(checks).splitlines()
    assert table[1].split() == ["FAIL", "all_reduce[cuda]", "timed", "out"]
    assert table[-1] == "3 checks, 1 failed"
    parsed = json.loads(format_json(checks))
    assert parsed["ok"] is False
    assert [c["status"] for c in parsed["checks"]] == [PASS, FAIL, SKIP]
