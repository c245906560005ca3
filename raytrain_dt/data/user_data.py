"""Your own data: any Ray Dataset, tokenized and packed once into a token dataset on disk.

Sources: parquet, JSONL and text files (a file, a directory or a glob), a Hugging Face
`datasets` directory written by `save_to_disk`, or a Ray Dataset object (Python API). Ray Data
reads the source and runs the tokenize map in parallel; one packing task on the driver's node
iterates the result *in order* (`preserve_order`), appends a separator after each document
(built-in tokenizers) and cuts the stream into `seq_len` rows, written as the same parquet
parts `prepare-data` writes. Sample id = row number of that frozen file, so the global order
(`data.order`), the per-DP-rank slices and the resume position apply unchanged: exactly-once
and resizes hold for user data because they only ever see a fixed, numbered set of samples
(docs/design.md).

The result is cached under `data.cache_dir` in a directory named by a hash: of the source's
files (paths, sizes, modification times) and the settings, for path sources, so a restarted
driver or a resubmitted job reuses it without tokenizing again; of the packed tokens themselves
for Ray Dataset objects, whose origin cannot be named. A directory appears only complete (it is
written under a temporary name and renamed). The temporary name holds the packer's host and
process id, so a packing that died (its worker killed, its node lost) is cleaned up by the next
packing on that host: its partial parts can be as large as the dataset.

The packing runs in a Ray task, not in the driver: the task owns Ray Data's tasks, so a crash of
Ray's core while it consumes them (a cancelled task's reply racing its cancellation,
ray-project/ray#54785, seen once in this project's CI) takes down a worker that Ray retries,
not the driver; and the documents' bytes never pass through the driver. The task is pinned to
the driver's node, where `data.cache_dir` is.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import shutil
import socket
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from raytrain_dt.data.parquet_read import read_parquet
from raytrain_dt.data.prepare import DOC_SEPARATOR, META_FILE, ROWS_PER_FILE, write_part
from raytrain_dt.data.remote import bucket_path, is_remote, list_files, s3_filesystem
from raytrain_dt.data.source import TokenDataset
from raytrain_dt.errors import DataError, UserError

log = logging.getLogger(__name__)

FORMAT_SUFFIXES = {
    "parquet": (".parquet",),
    "json": (".json", ".jsonl", ".json.gz", ".jsonl.gz"),
    "text": (".txt", ".md", ".py", ".rst"),
}
# Bumped whenever packing changes, so old caches are never mistaken for new ones.
PACKING_VERSION = 1
# Attempts after the packing task's worker died (a retry packs from the start, in a new
# temporary directory); an error the packing raised is never retried.
PACK_TASK_RETRIES = 2


@dataclass(frozen=True)
class PackSettings:
    seq_len: int
    text_column: str = "text"
    token_column: str | None = None
    # "bytes", a local Hugging Face tokenizer directory, or "custom" (a tokenize map given).
    tokenizer: str = "bytes"


class Tokenize:
    """The tokenize map (Ray Data `map_batches`, pyarrow batches): one `tokens` list per doc."""

    def __init__(self, settings: PackSettings):
        self.settings = settings
        self._hf = None

    def __call__(self, batch: pa.Table) -> pa.Table:
        s = self.settings
        if s.token_column:
            ids = batch.column(s.token_column).cast(pa.list_(pa.int32()))
            return pa.table({"tokens": ids})
        texts = batch.column(s.text_column).to_pylist()
        if s.tokenizer == "bytes":
            docs = [
                np.frombuffer((t or "").encode(), dtype=np.uint8).astype(np.int32) for t in texts
            ]
        else:
            if self._hf is None:
                from transformers import AutoTokenizer

                self._hf = AutoTokenizer.from_pretrained(s.tokenizer, local_files_only=True)
            docs = self._hf(texts, add_special_tokens=False)["input_ids"]
        return pa.table({"tokens": pa.array([list(d) for d in docs], type=pa.list_(pa.int32()))})


def separator_and_vocab(settings: PackSettings) -> tuple[int | None, int | None]:
    """The id appended after each document, and the vocabulary size (None: not known)."""
    if settings.tokenizer == "bytes" and not settings.token_column:
        return DOC_SEPARATOR, 256
    if settings.tokenizer in ("bytes", "custom"):
        return None, None  # token ids or a custom map: documents carry their own separators
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(settings.tokenizer, local_files_only=True)
    return tok.eos_token_id, len(tok)


# --- sources -------------------------------------------------------------------------------
def source_files(source: str, fmt: str) -> tuple[str, list[str]]:
    """(format, sorted files) of a file, directory or glob; `hf` for a save_to_disk directory.
    On S3: a file, a prefix or a glob, of `s3://` URIs (no `hf`)."""
    if is_remote(source):
        if fmt == "hf":
            raise DataError(f"data.source: {source}: a `datasets` directory must be local")
        return _known_format(source, fmt, list(list_files(source, "data.source")))
    path = Path(source)
    if path.is_dir() and (path / "dataset_info.json").is_file() and fmt in ("auto", "hf"):
        return "hf", sorted(str(p) for p in path.rglob("*") if p.is_file())
    if fmt == "hf":
        raise DataError(f"data.source: {source} is not a `datasets` save_to_disk directory")
    if path.is_dir():
        files = [
            str(p) for p in path.rglob("*") if p.is_file() and not p.name.startswith(("_", "."))
        ]
    else:
        files = [f for f in glob.glob(source, recursive=True) if Path(f).is_file()]
    return _known_format(source, fmt, sorted(files))


def _known_format(source: str, fmt: str, files: list[str]) -> tuple[str, list[str]]:
    if not files:
        raise DataError(f"data.source: {source} matches no files")
    if fmt == "auto":
        kinds = {k for f in files for k, sfx in FORMAT_SUFFIXES.items() if f.endswith(sfx)}
        if len(kinds) != 1:
            raise DataError(
                f"data.format: cannot tell the format of {source} from its file names "
                f"({', '.join(sorted(kinds)) or 'no known suffix'}); set data.format"
            )
        fmt = kinds.pop()
    return fmt, files


def read_source(source: str, fmt: str, task_env: dict[str, str] | None = None):
    """A Ray Dataset over the source, in file order. On S3 its read tasks open the files with
    pyarrow's S3 filesystem, with `task_env` (the variables the run forwards: credentials and
    endpoint, where no instance role gives them) in their environment."""
    import ray.data

    fmt, files = source_files(source, fmt)
    if fmt == "hf":
        import datasets

        return ray.data.from_huggingface(datasets.load_from_disk(source))
    options: dict = {}
    if is_remote(source):
        files = [bucket_path(f) for f in files]
        options["filesystem"] = s3_filesystem()
        if task_env:
            options["runtime_env"] = {"env_vars": dict(task_env)}
    if fmt == "parquet":
        return read_parquet(files, **options)
    if fmt == "json":
        return ray.data.read_json(files, **options)
    # One document per text file, as `prepare-data` does.
    raw = ray.data.read_binary_files(files, **options)
    return raw.map_batches(_decode_text, batch_format="pyarrow")


def _decode_text(batch: pa.Table) -> pa.Table:
    texts = [b.decode("utf-8", errors="replace") for b in batch.column("bytes").to_pylist()]
    return pa.table({"text": texts})


def source_key(source: str, fmt: str, settings: PackSettings) -> str:
    """A hash of the source's files (path, size, mtime) and the packing settings."""
    if is_remote(source):
        stats = [(f, *stat) for f, stat in list_files(source, "data.source").items()]
    else:
        _, files = source_files(source, fmt)
        stats = [(f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]
    blob = json.dumps([PACKING_VERSION, asdict(settings), fmt, stats], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# --- packing -------------------------------------------------------------------------------
def check_columns(ds, settings: PackSettings, what: str) -> None:
    if settings.tokenizer == "custom":
        return
    column = settings.token_column or settings.text_column
    names = list(ds.schema().names)
    if column not in names:
        key = "data.token_column" if settings.token_column else "data.text_column"
        raise DataError(f"{key}: no column {column!r} in {what} (columns: {', '.join(names)})")


class Packer:
    """Concatenates documents and writes full `seq_len` rows, ROWS_PER_FILE to a part file."""

    def __init__(self, out: Path, seq_len: int, separator: int | None):
        self.out, self.seq_len = out, seq_len
        self.separator = None if separator is None else np.array([separator], dtype=np.int32)
        self.pending: list[np.ndarray] = []
        self.buffered = self.num_rows = self.num_docs = self.max_id = self.parts = 0
        self.digest = hashlib.sha256()

    def add(self, doc: np.ndarray) -> None:
        self.pending.append(doc)
        if self.separator is not None:
            self.pending.append(self.separator)
        self.num_docs += 1
        self.buffered += len(doc) + (0 if self.separator is None else 1)
        if doc.size:
            self.max_id = max(self.max_id, int(doc.max()))
        if self.buffered >= ROWS_PER_FILE * self.seq_len:
            self._flush(ROWS_PER_FILE * self.seq_len)

    def finish(self) -> None:
        self._flush(self.seq_len)  # the last part takes every full row; the tail is dropped

    def _flush(self, block: int) -> None:
        stream = np.concatenate(self.pending) if self.pending else np.zeros(0, dtype=np.int32)
        usable = len(stream) // block * block
        rows = stream[:usable].reshape(-1, self.seq_len)
        for start in range(0, len(rows), ROWS_PER_FILE):
            chunk = rows[start : start + ROWS_PER_FILE]
            self.digest.update(chunk.tobytes())
            write_part(self.out, self.parts, self.num_rows, chunk)
            self.parts, self.num_rows = self.parts + 1, self.num_rows + len(chunk)
        self.pending, self.buffered = [stream[usable:]], len(stream) - usable


def pack(ds, settings: PackSettings, out: Path, separator: int | None) -> dict:
    """Iterate `ds` (docs with a `tokens` list column) in order; write seq_len rows to `out`."""
    ds.context.execution_options.preserve_order = True
    ds.context.enable_progress_bars = False
    out.mkdir(parents=True)
    packer = Packer(out, settings.seq_len, separator)
    for batch in ds.iter_batches(batch_size=1024, batch_format="pyarrow"):
        column = batch.column("tokens").combine_chunks()
        offsets = column.offsets.to_numpy()
        flat = column.values.to_numpy(zero_copy_only=False).astype(np.int32)
        for i in range(len(offsets) - 1):
            packer.add(flat[offsets[i] : offsets[i + 1]])
    packer.finish()
    if packer.num_rows == 0:
        raise DataError(
            f"data.source: {packer.num_docs} documents hold fewer tokens than one "
            f"sequence of data.seq_len={settings.seq_len}"
        )
    return {
        "num_samples": packer.num_rows,
        "num_documents": packer.num_docs,
        "max_token_id": packer.max_id,
        "content_sha256": packer.digest.hexdigest(),
    }


TMP_PREFIX = ".tmp-"  # then the packer's host, its process id and a random hex


def remove_dead_packings(cache_root: Path) -> list[Path]:
    """Remove the temporary directories of packings on this host whose process has died;
    those removed. Another host's (a shared cache_dir) and a live process's are left alone,
    and so is a name that says neither (written by an earlier version)."""
    host, removed = socket.gethostname(), []
    for tmp in cache_root.glob(f"{TMP_PREFIX}*"):
        owner_host, _, rest = tmp.name[len(TMP_PREFIX) :].rpartition("-")[0].rpartition("-")
        if owner_host != host or not rest.isdigit() or _process_alive(int(rest)):
            continue
        shutil.rmtree(tmp, ignore_errors=True)
        log.warning("removed %s, left by a packing whose process %s died", tmp, rest)
        removed.append(tmp)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


def materialize(
    ds,
    settings: PackSettings,
    cache_root: Path,
    key: str | None,
    what: str,
    tokenize: Callable | None = None,
) -> Path:
    """The packed token dataset of `ds` under cache_root (reused when `key` is cached)."""
    cache_root.mkdir(parents=True, exist_ok=True)
    if key is not None and (cache_root / key / META_FILE).is_file():
        log.info("user dataset %s: reusing the packed samples in %s", what, cache_root / key)
        return cache_root / key
    check_columns(ds, settings, what)
    separator, vocab = separator_and_vocab(settings)
    mapped = ds.map_batches(tokenize or Tokenize(settings), batch_format="pyarrow")
    remove_dead_packings(cache_root)
    tmp = cache_root / f"{TMP_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex}"
    try:
        meta = pack(mapped, settings, tmp, separator)
        meta.update(
            seq_len=settings.seq_len,
            source=what,
            settings=asdict(settings),
            separator=separator,
            vocab_size=vocab,
            tokenizer=settings.tokenizer,
        )
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
        final = cache_root / (key or meta["content_sha256"][:16])
        if (final / META_FILE).is_file():
            shutil.rmtree(tmp)  # the same content was packed before (or by a racing driver)
        else:
            os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info(
        "user dataset %s: %d samples of %d tokens from %d documents in %s",
        what,
        meta["num_samples"],
        settings.seq_len,
        meta["num_documents"],
        final,
    )
    return final


def materialize_on_this_node(
    ds,
    settings: PackSettings,
    cache_root: Path,
    key: str | None,
    what: str,
    tokenize: Callable | None = None,
) -> Path:
    """`materialize`, run in a Ray task on this process's node (see the module docstring);
    the packing's own error is raised here as itself, in one line."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if key is not None and (cache_root / key / META_FILE).is_file():
        return materialize(ds, settings, cache_root, key, what, tokenize)  # no task to start
    here = ray.get_runtime_context().get_node_id()
    task = ray.remote(materialize).options(
        name="raytrain_dt.pack",
        num_cpus=0,  # as the driver it stands in for: Ray Data's own tasks take the CPUs
        max_retries=PACK_TASK_RETRIES,
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
    )
    try:
        return ray.get(task.remote(ds, settings, cache_root, key, what, tokenize))
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, UserError):
            raise exc.cause from None
        raise


def open_user_dataset(
    data_cfg,
    cache_root: Path,
    vocab_size: int | None,
    dataset=None,
    tokenize: Callable | None = None,
    task_env: dict[str, str] | None = None,
) -> TokenDataset:
    """Pack `data.source` (or a Ray Dataset object) and open the result as a TokenDataset;
    `task_env`: for the read tasks of a source on S3 (`read_source`)."""
    settings = PackSettings(
        seq_len=data_cfg.seq_len,
        text_column=data_cfg.text_column,
        token_column=data_cfg.token_column,
        tokenizer="custom" if tokenize is not None else data_cfg.tokenizer,
    )
    if dataset is None:
        source = data_cfg.source
        key = source_key(source, data_cfg.format, settings) if tokenize is None else None
        ds = (
            read_source(source, data_cfg.format, task_env)
            if key is None or not (cache_root / key / META_FILE).is_file()
            else None
        )
        path = materialize_on_this_node(ds, settings, cache_root, key, source, tokenize)
    else:
        path = materialize_on_this_node(
            dataset, settings, cache_root, None, "the given Ray Dataset", tokenize
        )
    meta = json.loads((path / META_FILE).read_text())
    if vocab_size is not None and meta["max_token_id"] >= vocab_size:
        raise DataError(
            f"data.tokenizer: token id {meta['max_token_id']} does not fit the "
            f"model's vocabulary of {vocab_size}"
        )
    return TokenDataset.open(path, data_cfg.seq_len)
