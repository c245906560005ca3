"""Sizes and checksums of checkpoint files, computed where the bytes already are.

A checkpoint's manifest (every file with its size and checksum, in `commit.json`) must cost the
coordinator nothing per byte: a 70B run's checkpoint is about 1 TB, which the driver cannot
read at every commit and every (re)formation. So the bytes are hashed only on the ranks:

- Writing: each rank hashes what it writes, as it writes it. DCP's writers (the local one and
  fsspec's, so local paths and `s3://` alike) get a filesystem whose write streams hash the
  bytes on their way out (`DigestingFileSystem`; DCP's write-then-rename of `.metadata`
  included). DeepSpeed writes its files with torch.save on a local path; the rank hashes each
  right after writing it (`engines/deepspeed_files.py`: it is still in the page cache). RNG
  states are hashed from the buffer written. The rank reports its `FileDigests` in its `saved`
  report; the coordinator merges every rank's into the manifest (`store.merge_manifests`) and
  checks them against a listing of the step directory: names and sizes, metadata only.
- Loading: before any rank loads a checkpoint, the ranks verify it in parallel. The coordinator
  splits the manifest into one disjoint share per rank, balanced by bytes
  (`verification_shares`); each rank hashes its share (`verify_files`, called by
  `RankWorker.verify_checkpoint`) and the coordinator gathers every answer. Any problem, and no
  rank loads: the coordinator falls back to the previous committed checkpoint with a warning
  naming what was wrong. The coordinator itself only checks the commit record and the listed
  sizes.

Why disjoint shares rather than "each rank verifies the files its load plan reads": every file
is read once in the whole cluster (a plan-based check re-reads the files many ranks touch:
DCP's `.metadata`, deduplicated replicated tensors, every file of a resharded load), it needs no
hook inside each engine's reader (DCP, DeepSpeed's torch.load, the RNG states are all covered
alike), and the agreement is a gather on the coordinator, so a damaged file stops every rank
before any of them has loaded a byte. No torch here: the coordinator imports it too.

The checksum is XXH3-128 (`DIGEST`): it catches a damaged, truncated or swapped file as surely
as SHA-256 (tampering is for the storage's permissions to stop, not a checksum) at a tenth of
the CPU (18 against 1.8 GB/s on one core here), which a background write takes from training
on the host. Each entry names its algorithm, so checkpoints recorded with SHA-256 by earlier
versions still verify.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import os
import threading
from collections.abc import Callable, Iterator

import xxhash

from raytrain_dt.checkpoint.storage import Location

DIGEST = "xxh3_128"  # what new manifests record
# Every algorithm a manifest may name (SHA-256: checkpoints of earlier versions).
HASHERS: dict[str, Callable] = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}

CHUNK = 8 << 20  # bytes per read when hashing a stored file


class FileDigests:
    """The files one rank wrote for one save: name relative to the step directory ->
    {"size", DIGEST}. Thread-safe: DCP writes from several threads."""

    def __init__(self) -> None:
        self._files: dict[str, dict] = {}
        self._lock = threading.Lock()

    def add(self, name: str, size: int, digest: str) -> None:
        with self._lock:
            self._files[name] = {"size": int(size), DIGEST: digest}

    def add_bytes(self, name: str, data: bytes) -> None:
        """`name` was written with exactly `data`."""
        self.add(name, len(data), HASHERS[DIGEST](data).hexdigest())

    def add_stored(self, location: Location, name: str) -> None:
        """`name` below `location` was just written by this process: hash it as stored."""
        self.add(name, *file_digest(location.child(name)))

    def rename(self, old: str, new: str) -> None:
        with self._lock:
            if old in self._files:
                self._files[new] = self._files.pop(old)

    def discard(self, name: str) -> None:
        with self._lock:
            self._files.pop(name, None)

    def manifest(self) -> dict[str, dict]:
        with self._lock:
            return {name: dict(entry) for name, entry in sorted(self._files.items())}


class HashingStream:
    """A writable file object that hashes and counts every byte passing through to `raw`;
    everything else (tell, flush, fileno, close) is `raw`'s."""

    def __init__(self, raw) -> None:
        self.raw = raw
        self.size = 0
        self._hash = HASHERS[DIGEST]()

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        written = self.raw.write(view)
        count = len(view) if written is None else written
        self._hash.update(view[:count])
        self.size += count
        return written

    def hexdigest(self) -> str:
        return self._hash.hexdigest()

    def __getattr__(self, name: str):
        return getattr(self.raw, name)


class DigestingFileSystem:
    """A DCP writer's filesystem (torch's `FileSystemBase`: the local one or fsspec's) whose
    write streams are hashed as DCP writes them, recorded in `digests` relative to the
    writer's directory once the file is closed (on S3: uploaded). A rename or removal moves or
    drops the record, so `.metadata`, written as `.metadata.tmp` and renamed, is recorded
    under its final name."""

    def __init__(self, writer, digests: FileDigests) -> None:
        self._inner = writer.fs
        self._writer = writer  # its `path` is the root names are relative to
        self._digests = digests

    @contextlib.contextmanager
    def create_stream(self, path, mode: str) -> Iterator:
        if "w" not in mode:  # reads, and DCP never appends
            with self._inner.create_stream(path, mode) as stream:
                yield stream
            return
        with self._inner.create_stream(path, mode) as raw:
            stream = HashingStream(raw)
            yield stream
        self._digests.add(self._relative(path), stream.size, stream.hexdigest())

    def rename(self, path, new_path) -> None:
        self._inner.rename(path, new_path)
        self._digests.rename(self._relative(path), self._relative(new_path))

    def rm_file(self, path) -> None:
        self._inner.rm_file(path)
        self._digests.discard(self._relative(path))

    def _relative(self, path) -> str:
        root, full = os.fspath(self._writer.path).rstrip("/"), os.fspath(path)
        if not full.startswith(root + "/"):
            raise ValueError(f"{full}: written outside the checkpoint directory {root}")
        return full[len(root) + 1 :]

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def file_digest(location: Location, algorithm: str = DIGEST) -> tuple[int, str]:
    """(size, checksum by `algorithm`) of a stored file, read in chunks."""
    digest, size = HASHERS[algorithm](), 0
    with location.fs.open(location.path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def digest_tree(uri: str) -> dict[str, dict]:
    """{name: {size, DIGEST}} of every file below `uri`, hashed as stored: what a single
    writer of all of them reports (tests, benchmarks, offline tools; never the coordinator)."""
    loc = Location.parse(uri)
    digests = FileDigests()
    for name in loc.files():
        digests.add_stored(loc, name)
    return digests.manifest()


def verify_files(uri: str, files: dict[str, dict]) -> list[str]:
    """What is wrong with `files` ({name: {size, checksum}}, by whichever algorithm each entry
    names) below `uri`: one line per missing, resized or changed file; empty when all are as
    recorded. Run by a rank on its share."""
    loc = Location.parse(uri)
    problems = []
    for name, expected in sorted(files.items()):
        algorithm = next((a for a in HASHERS if a in expected), None)
        if algorithm is None:
            problems.append(f"{uri}/{name}: no checksum recorded (one of {', '.join(HASHERS)})")
            continue
        try:
            size, digest = file_digest(loc.child(name), algorithm)
        except FileNotFoundError:
            problems.append(f"{uri}/{name}: missing")
            continue
        if size != expected["size"]:
            problems.append(f"{uri}/{name}: size {size} != {expected['size']} recorded")
        elif digest != expected[algorithm]:
            problems.append(f"{uri}/{name}: checksum mismatch")
    return problems


def verification_shares(files: dict[str, dict], ranks: int) -> list[dict[str, dict]]:
    """`files` split into `ranks` disjoint shares of about equal bytes (largest file first, each
    to the share with the fewest bytes so far): every file is verified by exactly one rank."""
    shares: list[dict[str, dict]] = [{} for _ in range(ranks)]
    loads = [(0, rank) for rank in range(ranks)]  # a heap of (bytes so far, rank)
    for name, entry in sorted(files.items(), key=lambda item: (-item[1]["size"], item[0])):
        load, rank = heapq.heappop(loads)
        shares[rank][name] = entry
        heapq.heappush(loads, (load + entry["size"], rank))
    return shares
