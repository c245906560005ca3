"""Data on S3: a prepared token dataset (`data.path`) and a raw source (`data.source`) read
from moto's server on localhost (`tests/s3_server.py`) through pyarrow's S3 filesystem, with
the sample ledger exactly the documented global order; unusable S3 input is one line, exit 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from reference import global_batch_ids
from s3_server import BUCKET, S3_ENV, remove_credentials, s3_endpoint  # noqa: F401

from raytrain_dt.cli import main
from raytrain_dt.control.coordinator import train
from raytrain_dt.data.source import TokenDataset
from raytrain_dt.data.user_data import open_user_dataset
from raytrain_dt.observe.metrics import read_jsonl

# The server for the whole module: fixtures imported from `s3_server` are this module's.
pytestmark = pytest.mark.usefixtures("ray_cluster", "s3_endpoint")
FORWARD = f"cluster.forward_env=[{','.join(S3_ENV)}]"


def _upload(local: Path, prefix: str) -> str:
    """Every file below `local` (or `local` itself) under s3://BUCKET/prefix; the URI."""
    import boto3

    client = boto3.client("s3")
    files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
    for path in files:
        name = path.name if local.is_file() else path.relative_to(local).as_posix()
        client.upload_file(str(path), BUCKET, f"{prefix}/{name}")
    return f"s3://{BUCKET}/{prefix}" + (f"/{local.name}" if local.is_file() else "")


def _check_ledger(run_dir: Path, cfg, dataset: TokenDataset, steps: int) -> None:
    ledger = read_jsonl(run_dir / "ledger.jsonl")
    assert [r["step"] for r in ledger] == list(range(1, steps + 1))
    seen = []
    for record in ledger:
        expected = global_batch_ids(cfg, dataset, record["step"] - 1).tolist()
        assert record["sample_ids"] == expected
        seen += record["sample_ids"]
    assert len(seen) == len(set(seen))  # within one epoch: every sample at most once


def test_prepared_dataset_on_s3_trains_with_the_exact_ledger(make_config, token_data, tmp_path):
    uri = _upload(token_data, "data/tokens")
    local = TokenDataset.open(token_data, 64)
    remote = TokenDataset.open(uri, 64)
    assert remote.row_counts == local.row_counts
    ids = [0, local.num_samples - 1, local.num_samples // 2]
    assert (remote.read(ids) == local.read(ids)).all()

    steps = 4
    run_dir = tmp_path / "s3data"
    cfg = make_config(f"data.path={uri}", f"trainer.steps={steps}", FORWARD, run_dir=run_dir)
    train(cfg, show_progress=False)
    _check_ledger(run_dir, cfg, local, steps)


def test_raw_source_on_s3_is_packed_as_the_local_one(make_config, user_docs, tmp_path):
    uri = _upload(user_docs / "docs.jsonl", "data/raw")
    steps = 3
    run_dir = tmp_path / "s3source"
    cfg = make_config(f"data.source={uri}", f"trainer.steps={steps}", FORWARD, run_dir=run_dir)
    train(cfg, show_progress=False)
    (meta,) = (run_dir / "data_cache").glob("*/_dataset.json")
    packed = TokenDataset.open(meta.parent, cfg.data.seq_len)
    _check_ledger(run_dir, cfg, packed, steps)
    # The same documents packed from a local copy: the same samples.
    cfg.data.source = str(user_docs / "docs.jsonl")
    local = open_user_dataset(cfg.data, tmp_path / "local_cache", None)
    packed_here = json.loads(meta.read_text())["content_sha256"]
    local_meta = Path(local.path) / "_dataset.json"
    assert packed_here == json.loads(local_meta.read_text())["content_sha256"]


@pytest.mark.parametrize("key", ["data.path", "data.source"])
def test_unusable_s3_data_is_one_line(key, tmp_path, capsys, monkeypatch):
    args = ["train", "conf/test.yaml", f"run.dir={tmp_path / 'run'}"]
    missing = f"s3://{BUCKET}/no/such/prefix"
    assert main([*args, f"{key}={missing}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and key in err and missing in err

    remove_credentials(monkeypatch, tmp_path / "none")
    assert main([*args, f"{key}=s3://{BUCKET}/data/x"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {key}: ")
    assert "no AWS credentials" in err
