"""prepare-data round trips, the global sample order, and dataset validation errors."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain_dt.data.order import rank_positions, sample_ids
from raytrain_dt.data.prepare import DOC_SEPARATOR, prepare_dataset
from raytrain_dt.data.source import TokenDataset
from raytrain_dt.errors import DataError


def test_prepare_round_trips_the_text(tmp_path):
    texts = {"a.txt": "hello world\n" * 40, "b.txt": "ünïcode ✓ lines\n" * 30}
    for name, text in texts.items():
        (tmp_path / name).write_text(text)
    meta = prepare_dataset(tmp_path / "ds", str(tmp_path / "*.txt"), seq_len=16)
    expected = b"".join(texts[n].encode() + bytes([DOC_SEPARATOR]) for n in sorted(texts))
    ds = TokenDataset.open(tmp_path / "ds", 16)
    assert ds.num_samples == meta["num_samples"] == len(expected) // 16
    rows = ds.read(np.arange(ds.num_samples))
    assert bytes(rows.reshape(-1).astype(np.uint8)) == expected[: ds.num_samples * 16]


def test_read_takes_rows_in_the_order_asked_across_files(tmp_path, monkeypatch):
    import raytrain_dt.data.prepare as prepare

    monkeypatch.setattr(prepare, "ROWS_PER_FILE", 7)
    (tmp_path / "t.txt").write_text("".join(chr(65 + i % 26) for i in range(16 * 50)))
    prepare_dataset(tmp_path / "ds", str(tmp_path / "t.txt"), seq_len=16)
    ds = TokenDataset.open(tmp_path / "ds", 16)
    assert len(ds.files) > 3
    everything = ds.read(np.arange(ds.num_samples))
    ids = np.array([30, 2, 17, 9, 2])
    assert np.array_equal(ds.read(ids), everything[ids])


def test_global_order_is_a_permutation_per_epoch_and_independent_of_dp():
    n, g = 50, 12
    positions = np.arange(3 * n)
    ids = sample_ids(positions, n, seed=7)
    for epoch in range(3):
        assert sorted(ids[epoch * n : (epoch + 1) * n]) == list(range(n))
    assert not np.array_equal(ids[:n], ids[n : 2 * n])
    # Any DP degree that divides the batch reads the same positions for the step, in order.
    for dp in (1, 2, 3, 4, 6):
        per_step = [rank_positions(24, 5, g, dp, r).reshape(5, -1) for r in range(dp)]
        joined = np.concatenate(per_step, axis=1).reshape(-1)
        assert np.array_equal(joined, np.arange(24, 24 + 5 * g))


def test_missing_empty_and_wrong_schema_datasets_give_one_line(tmp_path):
    with pytest.raises(DataError, match=r"dataset path does not exist \(data.path\)"):
        TokenDataset.open(tmp_path / "missing", 16)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no parquet files"):
        TokenDataset.open(tmp_path / "empty", 16)
    (tmp_path / "wrong").mkdir()
    pq.write_table(pa.table({"text": ["a", "b"]}), tmp_path / "wrong" / "x.parquet")
    with pytest.raises(DataError, match=r"no 'tokens' column \(columns: text\)"):
        TokenDataset.open(tmp_path / "wrong", 16)
    (tmp_path / "zero").mkdir()
    pq.write_table(
        pa.table({"tokens": pa.array([], pa.list_(pa.int32(), 16))}),
        tmp_path / "zero" / "x.parquet",
    )
    with pytest.raises(DataError, match="dataset is empty"):
        TokenDataset.open(tmp_path / "zero", 16)
    (tmp_path / "t.txt").write_text("x" * 100)
    prepare_dataset(tmp_path / "ds", str(tmp_path / "t.txt"), seq_len=8)
    with pytest.raises(DataError, match="sequences have 8 tokens but data.seq_len=16"):
        TokenDataset.open(tmp_path / "ds", 16)
