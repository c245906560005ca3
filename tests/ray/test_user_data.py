"""User data (`data.source`): parquet, JSONL, text files and `datasets` directories are
tokenized and packed exactly as `prepare-data` packs text, cached by source, and keep the
exactly-once guarantee across a resize (sample ledger against the documented global order).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from reference import global_batch_ids, reference_run

from raytrain_dt.cli import main
from raytrain_dt.config.schema import DataConfig
from raytrain_dt.control.coordinator import train
from raytrain_dt.data import parquet_read, user_data
from raytrain_dt.data.prepare import prepare_dataset
from raytrain_dt.data.source import TokenDataset
from raytrain_dt.data.user_data import open_user_dataset
from raytrain_dt.observe.metrics import read_jsonl

pytestmark = pytest.mark.usefixtures("ray_cluster")
SEQ_LEN = 64


def _docs(user_docs: Path) -> list[dict]:
    return [json.loads(line) for line in (user_docs / "docs.jsonl").read_text().splitlines()]


def _sources(user_docs: Path, tmp: Path) -> dict[str, str]:
    """The same documents, in the same order, in each supported format."""
    docs = _docs(user_docs)
    pq.write_table(pa.Table.from_pylist(docs), tmp / "docs.parquet")
    import datasets

    datasets.Dataset.from_list(docs).save_to_disk(str(tmp / "hf"))
    return {
        "jsonl": str(user_docs / "docs.jsonl"),
        "parquet": str(tmp / "docs.parquet"),
        "text": str(user_docs / "text"),
        "hf": str(tmp / "hf"),
    }


def _packed_in_the_driver(*args, **kwargs):
    raise AssertionError("the driver iterated the Ray Dataset itself")


def test_every_format_packs_the_samples_prepare_data_writes(user_docs, tmp_path, monkeypatch):
    # The packing runs in a task on this node, never in the driver (a crash of Ray's core
    # while Ray Data's tasks are consumed must not take the driver down): here, in the
    # driver's process, packing fails.
    monkeypatch.setattr(user_data, "pack", _packed_in_the_driver)
    expected_dir = tmp_path / "prepared"
    prepare_dataset(expected_dir, str(user_docs / "text" / "*.txt"), seq_len=SEQ_LEN)
    expected = TokenDataset.open(expected_dir, SEQ_LEN)
    ids = list(range(expected.num_samples))
    for name, source in _sources(user_docs, tmp_path).items():
        data = DataConfig(source=source, seq_len=SEQ_LEN)
        packed = open_user_dataset(data, tmp_path / "cache", vocab_size=256)
        assert packed.num_samples == expected.num_samples, name
        assert (packed.read(ids) == expected.read(ids)).all(), name
        # Cached by source and settings: opening it again packs nothing.
        stamp = Path(packed.files[0]).stat().st_mtime_ns
        again = open_user_dataset(data, tmp_path / "cache", vocab_size=256)
        assert again.path == packed.path and Path(again.files[0]).stat().st_mtime_ns == stamp

    def tokenize(batch: pa.Table) -> pa.Table:  # a user's map: bytes and its own end-of-doc id
        docs = [[*text.encode(), 0] for text in batch.column("text").to_pylist()]
        return pa.table({"tokens": pa.array(docs, type=pa.list_(pa.int32()))})

    data = DataConfig(source=str(user_docs / "docs.jsonl"), seq_len=SEQ_LEN)
    custom = open_user_dataset(data, tmp_path / "cache", vocab_size=256, tokenize=tokenize)
    assert (custom.read(ids) == expected.read(ids)).all()


def test_missing_text_column_is_one_line(user_docs, tmp_path, capsys):
    code = main(
        [
            "train",
            "conf/test.yaml",
            f"run.dir={tmp_path / 'run'}",
            f"data.source={user_docs / 'docs.jsonl'}",
            "data.text_column=body",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: data.text_column: no column 'body' in {user_docs / 'docs.jsonl'} "
        "(columns: id, text)"
    )


def _footer_readers_planned(ds) -> int:
    """The size of the footer-reading actor pool in a parquet read's plan (Ray Data 2.60's
    `ListFiles` operator and its `FooterFileIndexer`)."""
    ops = [ds._logical_plan.dag]
    while ops:
        op = ops.pop()
        if type(op).__name__ == "ListFiles":
            return op.file_indexer._num_actors
        ops += op.input_dependencies
    raise AssertionError("no ListFiles operator in the read's plan")


def test_a_parquet_read_starts_one_footer_reader_per_batch_of_files(tmp_path, monkeypatch):
    # Ray Data's default is 32 actors, a process each, whatever the files: a read of one file
    # started 10 on this host (22 CPU-s).
    files = []
    for i in range(25):
        files.append(str(tmp_path / f"part-{i}.parquet"))
        pq.write_table(pa.table({"text": [f"document {i}"]}), files[-1])
    monkeypatch.delenv(parquet_read.POOL_SIZE_VARIABLE, raising=False)
    assert _footer_readers_planned(parquet_read.read_parquet(files[:3])) == 1
    assert _footer_readers_planned(parquet_read.read_parquet(files)) == 3  # batches of 10
    assert parquet_read.POOL_SIZE_VARIABLE not in os.environ  # set only while planning
    # A pool size the user chose is theirs.
    monkeypatch.setenv(parquet_read.POOL_SIZE_VARIABLE, "5")
    assert _footer_readers_planned(parquet_read.read_parquet(files[:3])) == 5
    assert parquet_read.read_parquet(files).count() == 25


# A node lost mid-run and the re-formation after it: 143-146 s in the gate beside another
# worker, half the default 300.
@pytest.mark.timeout(600)
def test_jsonl_samples_are_seen_exactly_once_across_a_lost_node(
    restore_nodes, make_config, user_docs
):
    steps = 8
    cfg = make_config(
        f"data.source={user_docs / 'docs.jsonl'}",
        f"trainer.steps={steps}",
        "checkpoint.every_steps=3",
        "cluster.num_ranks=null",
        "engine.zero_stage=3",
        "chaos_step_delay_s=0.3",
        "chaos=[{at_step: 6, action: kill_node, target: 3}]",
    )
    result = train(cfg, simulated_cluster=restore_nodes, show_progress=False)
    events = read_jsonl(f"{result.run_dir}/events.jsonl")
    (resize,) = [e for e in events if e["event"] == "resize"]
    # The run shrinks onto both of the other node's ranks, kept (none replaced).
    (start,) = [e for e in events if e["event"] == "start"]
    assert resize["old_layout"]["dims"]["world_size"] == 4
    assert resize["new_layout"]["dims"]["world_size"] == 2
    assert resize["kept_actors"] == start["new_actors"][:2] and resize["new_actors"] == []

    (meta,) = Path(result.run_dir, "data_cache").glob("*/_dataset.json")
    packed = TokenDataset.open(meta.parent, cfg.data.seq_len)
    ledger = read_jsonl(f"{result.run_dir}/ledger.jsonl")
    assert [r["step"] for r in ledger] == list(range(1, steps + 1))
    for record in ledger:
        assert record["sample_ids"] == global_batch_ids(cfg, packed, record["step"] - 1).tolist()
    # And the run trained on them as the single-process reference does.
    cfg.data.path, cfg.data.source = str(meta.parent), None
    ref_losses, _ = reference_run(cfg, steps)
    losses = [m["loss"] for m in read_jsonl(f"{result.run_dir}/metrics.jsonl")]
    assert losses == pytest.approx(ref_losses, abs=1e-4)
