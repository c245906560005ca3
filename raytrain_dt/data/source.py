"""A token dataset on disk: validated once, then read by global sample id.

`TokenDataset.open` checks the path, the files and the schema and raises a one-line
`DataError` naming what is wrong. `read` maps sample ids to (file, row) and takes the rows from
memory-mapped parquet tables, so a Ray Data task touches only the rows it serves. A dataset on
S3 (`data.path: s3://...`, see `data.remote`) is opened from a listing and the parquet footers
(the driver reads no rows); the Ray Data tasks that serve rows read each file's token column
once and keep it (as they keep a local file's mapping).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raytrain_dt.data.remote import bucket_path, is_remote, list_files, s3_filesystem
from raytrain_dt.errors import DataError

TOKENS_COLUMN = "tokens"


@dataclass(frozen=True)
class TokenDataset:
    path: str
    files: tuple[str, ...]
    row_counts: tuple[int, ...]
    seq_len: int

    @property
    def num_samples(self) -> int:
        return sum(self.row_counts)

    @classmethod
    def open(cls, path: str | Path, seq_len: int) -> TokenDataset:
        if is_remote(path):
            root = str(path)
            files = [f for f in list_files(root, "data.path") if f.endswith(".parquet")]
        else:
            root = Path(path)
            if not root.exists():
                raise DataError(f"{root}: dataset path does not exist (data.path)")
            files = (
                sorted(str(f) for f in root.rglob("*.parquet")) if root.is_dir() else [str(root)]
            )
        if not files:
            raise DataError(f"{root}: no parquet files in the dataset directory (data.path)")
        counts = []
        for name in files:
            try:
                meta = _parquet_file(name)
            except (pa.ArrowInvalid, OSError) as exc:
                raise DataError(f"{name}: not a readable parquet file ({exc})") from exc
            _check_schema(name, meta.schema_arrow, seq_len)
            counts.append(meta.metadata.num_rows)
        if sum(counts) == 0:
            raise DataError(f"{root}: dataset is empty (0 rows in {len(files)} files)")
        return cls(str(root), tuple(files), tuple(counts), seq_len)

    def read(self, ids: np.ndarray) -> np.ndarray:
        """Token rows (len(ids), seq_len) int32 for global sample ids, in the order given."""
        ids = np.asarray(ids, dtype=np.int64)
        bounds = np.cumsum((0, *self.row_counts))
        file_index = np.searchsorted(bounds, ids, side="right") - 1
        out = np.empty((len(ids), self.seq_len), dtype=np.int32)
        for f in np.unique(file_index):
            mask = file_index == f
            rows = ids[mask] - bounds[f]
            column = _tokens_table(self.files[f]).column(TOKENS_COLUMN).take(pa.array(rows))
            flat = column.combine_chunks().flatten().to_numpy(zero_copy_only=False)
            out[mask] = flat.reshape(-1, self.seq_len)
        return out


def _check_schema(name: str, schema: pa.Schema, seq_len: int) -> None:
    if TOKENS_COLUMN not in schema.names:
        raise DataError(f"{name}: no '{TOKENS_COLUMN}' column (columns: {', '.join(schema.names)})")
    column_type = schema.field(TOKENS_COLUMN).type
    if not (pa.types.is_list(column_type) or pa.types.is_fixed_size_list(column_type)) or not (
        pa.types.is_integer(column_type.value_type)
    ):
        raise DataError(
            f"{name}: column '{TOKENS_COLUMN}' is {column_type}, expected a list of ints"
        )
    if pa.types.is_fixed_size_list(column_type) and column_type.list_size != seq_len:
        raise DataError(
            f"{name}: sequences have {column_type.list_size} tokens but data.seq_len={seq_len}"
        )


def _parquet_file(name: str) -> pq.ParquetFile:
    """The file's footer (schema, row count), read; its rows are not."""
    if is_remote(name):
        return pq.ParquetFile(s3_filesystem().open_input_file(bucket_path(name)))
    return pq.ParquetFile(name)


# Bytes of decoded token columns one process keeps (`_TableCache`).
READ_CACHE_BYTES = 1 << 30


class _TableCache:
    """The decoded token columns of the files this process read last, up to a byte budget,
    the least recently used dropped first. Reads follow the shuffled global order, so a fetch
    of 256 rows touches a few hundred files: a cache bounded by a count of files (64, before)
    re-read most of them at every fetch once a dataset had more (0.45 s a fetch, 572 samples/s,
    for the 309-file bench dataset), which several concurrent tasks per pipeline had hidden."""

    def __init__(self, budget_bytes: int) -> None:
        self._budget = budget_bytes
        self._tables: OrderedDict[str, pa.Table] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # the rank's in-process reads and its prefetch thread

    def get(self, name: str) -> pa.Table:
        with self._lock:
            table = self._tables.get(name)
            if table is not None:
                self._tables.move_to_end(name)
                return table
        table = _read_tokens_table(name)
        with self._lock:
            if name not in self._tables:
                self._tables[name] = table
                self._bytes += table.nbytes
                while self._bytes > self._budget and len(self._tables) > 1:
                    _, dropped = self._tables.popitem(last=False)
                    self._bytes -= dropped.nbytes
        return table


_tables = _TableCache(READ_CACHE_BYTES)


def _tokens_table(name: str) -> pa.Table:
    return _tables.get(name)


def _read_tokens_table(name: str) -> pa.Table:
    if is_remote(name):
        # One GET of the column per file per task process, then served from memory.
        return pq.read_table(bucket_path(name), columns=[TOKENS_COLUMN], filesystem=s3_filesystem())
    # Memory-mapped: repeated takes from one file cost page faults, not re-reads.
    return pq.read_table(name, columns=[TOKENS_COLUMN], memory_map=True)
