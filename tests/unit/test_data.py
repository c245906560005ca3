"""prepare-data round trips, the global sample order, and dataset validation errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain_dt.data.order import rank_positions, rank_rows, sample_ids
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


def test_the_read_cache_keeps_the_last_used_files_within_its_byte_budget(tmp_path, monkeypatch):
    """Each file is read once while it stays in the cache; past the budget the least recently
    used goes first, and the cache holds no more bytes than the budget (beyond the newest)."""
    from raytrain_dt.data import source

    files = []
    for i in range(4):
        path = tmp_path / f"{i}.parquet"
        rows = pa.array([[i * 100 + r] * 16 for r in range(100)], pa.list_(pa.int32(), 16))
        pq.write_table(pa.table({"tokens": rows}), path)
        files.append(str(path))
    reads = []
    monkeypatch.setattr(
        source, "_read_tokens_table", lambda name: reads.append(name) or pq.read_table(name)
    )
    one = pq.read_table(files[0]).nbytes
    cache = source._TableCache(budget_bytes=2 * one + one // 2)  # two files fit, not three
    for name in (files[0], files[1], files[0], files[2], files[0], files[1]):
        table = cache.get(name)
        assert table.column("tokens")[0].as_py()[0] == int(Path(name).stem) * 100
    # files[1] was the least recently used when files[2] came in, so it alone was read again.
    assert reads == [files[0], files[1], files[2], files[1]]
    assert list(cache._tables) == [files[0], files[1]] and cache._bytes <= 2 * one + one // 2


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


@pytest.mark.parametrize(("g", "dp", "slots"), [(16, 3, 0), (16, 3, 8), (8, 3, 4), (12, 4, 0)])
def test_uneven_dp_reads_each_position_once_in_balanced_slices(g, dp, slots):
    """Real rows over the ranks are the step's positions in order; padding fills the slots."""
    steps = 4
    reads = [rank_rows(24, steps, g, dp, r, slots) for r in range(dp)]
    width = slots or -(-g // dp)
    for positions, real in reads:
        assert positions.shape == real.shape == (steps * width,)
    real_rows = [p.reshape(steps, -1)[m.reshape(steps, -1)].reshape(steps, -1) for p, m in reads]
    joined = np.concatenate(real_rows, axis=1).reshape(-1)
    assert np.array_equal(joined, np.arange(24, 24 + steps * g))
    counts = [r.shape[1] for r in real_rows]
    assert max(counts) - min(counts) <= 1 and sum(counts) == g
    for positions, _ in reads:  # a padding row is one of the step's own positions
        step = (positions - 24) // g
        assert np.array_equal(step, np.repeat(np.arange(steps), width))
    if g % dp == 0 and not slots:
        for r, (positions, real) in enumerate(reads):
            assert real.all() and np.array_equal(positions, rank_positions(24, steps, g, dp, r))


def test_rank_rows_refuses_slots_a_slice_does_not_fit():
    with pytest.raises(ValueError, match="reads 6 of global batch 16: needs 1 to 5"):
        rank_rows(0, 1, 16, 3, 2, slots=5)


def test_ledger_lists_only_real_samples_once(token_data):
    """Three ranks of global batch 16 through the real fetch and train loop: the ids they
    report for the ledger are the reference global batches, and padding rows are skipped."""
    import threading

    import torch

    from raytrain_dt.data.input_pipeline import ROW_COLUMN, DataSlice, _fetch
    from raytrain_dt.engines.base import StepResult
    from raytrain_dt.worker.train_loop import LoopSpec, run_loop

    dataset = TokenDataset.open(token_data, 64)
    g, dp, micro, accum, steps, seed = 16, 3, 3, 2, 3, 5

    class CountingEngine:
        real_rows = 0

        def train_step(self, micro_batches, step, real=None):
            assert [m.shape[0] for m in micro_batches] == [micro] * accum
            self.real_rows += sum(int(r.sum()) for r in real)
            return StepResult(0.0, 0.0, 0.0)

    by_step: dict[int, list[int]] = {}
    engine = CountingEngine()
    for r in range(dp):
        data = DataSlice(dataset, seed, 16, steps, g, dp, r, micro, slots=micro * accum)
        rows = [
            _fetch({ROW_COLUMN: np.arange(i, i + micro)}, data)
            for i in range(0, data.num_rows, micro)
        ]
        batches = iter([{k: torch.as_tensor(v) for k, v in b.items()} for b in rows])
        spec = LoopSpec(1, 1 + steps, 16, g, accum, 64, 0, False, True)
        reports: list[dict] = []
        run_loop(engine, batches, spec, reports.append, lambda *a: None, threading.Event())
        for rep in reports:
            by_step.setdefault(rep.step, []).extend(rep.sample_ids)
    assert engine.real_rows == steps * g
    for step, ids in by_step.items():  # step k (1-based) consumed positions [(k-1)G, kG) + 16
        expected = sample_ids(
            np.arange(16 + (step - 2) * g, 16 + (step - 1) * g), dataset.num_samples, seed
        )
        assert ids == expected.tolist()


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
