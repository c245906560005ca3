"""Text files -> a parquet dataset of fixed-length token sequences (`raytrain-dt prepare-data`).

The byte-level tokenizer maps each UTF-8 byte to one token (vocabulary 256), and documents are
joined with a NUL byte as separator. With no glob the corpus is the Python standard library's
own source, so the demo trains on real text with no download.
"""

from __future__ import annotations

import glob
import json
import logging
import sysconfig
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raytrain_dt.errors import DataError

log = logging.getLogger(__name__)

DOC_SEPARATOR = 0  # NUL: never present in source text, so it marks document boundaries
ROWS_PER_FILE = 8192
META_FILE = "_dataset.json"


def stdlib_glob() -> str:
    return str(Path(sysconfig.get_paths()["stdlib"]) / "**" / "*.py")


def byte_tokenize(text_bytes: bytes) -> np.ndarray:
    return np.frombuffer(text_bytes, dtype=np.uint8).astype(np.int32)


def _token_stream(files: list[str], max_tokens: int | None) -> np.ndarray:
    chunks, total = [], 0
    for name in files:
        data = Path(name).read_bytes()
        chunks.append(byte_tokenize(data))
        chunks.append(np.array([DOC_SEPARATOR], dtype=np.int32))
        total += len(data) + 1
        if max_tokens is not None and total >= max_tokens:
            break
    stream = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)
    return stream[:max_tokens] if max_tokens is not None else stream


def write_part(out: Path, part: int, start: int, rows: np.ndarray) -> Path:
    """Write sequences `rows` (n, seq_len), sample ids from `start`, as part file `part`."""
    seq_len = rows.shape[1]
    column = pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1).astype(np.int32)), seq_len)
    table = pa.table(
        {
            "sample_id": pa.array(np.arange(start, start + len(rows), dtype=np.int64)),
            "tokens": column,
        },
        schema=pa.schema([("sample_id", pa.int64()), ("tokens", pa.list_(pa.int32(), seq_len))]),
    )
    path = out / f"part-{part:05d}.parquet"
    pq.write_table(table, path)
    return path


def prepare_dataset(
    out: str | Path, text_glob: str | None = None, seq_len: int = 128, max_tokens: int | None = None
) -> dict:
    """Tokenize every file matching `text_glob` (sorted, so the result is reproducible)."""
    if seq_len < 2:
        raise DataError(f"--seq-len: must be >= 2, got {seq_len}")
    pattern = text_glob or stdlib_glob()
    files = sorted(f for f in glob.glob(pattern, recursive=True) if Path(f).is_file())
    if not files:
        raise DataError(f"{pattern}: no files match the text glob")
    stream = _token_stream(files, max_tokens)
    num_samples = len(stream) // seq_len
    if num_samples == 0:
        raise DataError(f"{pattern}: {len(stream)} tokens, fewer than one sequence of {seq_len}")
    tokens = stream[: num_samples * seq_len].reshape(num_samples, seq_len)

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("part-*.parquet"):
        old.unlink()
    for part, start in enumerate(range(0, num_samples, ROWS_PER_FILE)):
        write_part(out, part, start, tokens[start : start + ROWS_PER_FILE])
    meta = {
        "num_samples": int(num_samples),
        "seq_len": seq_len,
        "tokenizer": "bytes",
        "vocab_size": 256,
        "source_glob": pattern,
        "num_files": len(files),
    }
    (out / META_FILE).write_text(json.dumps(meta, indent=2))
    log.info(
        "prepared %d sequences of %d tokens from %d files into %s",
        num_samples,
        seq_len,
        len(files),
        out,
    )
    return meta
