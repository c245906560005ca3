"""Part (c) of bench/bench_checkpoint.py: the driver's commit time for checkpoints of 100 MB,
1 GB and 4 GB, with the checkpoint bytes it reads while committing (every open and read of the
process counted), and beside it the ranks' cost of writing: the checksum alone, and the shards
written and fsynced as DCP writes them, with and without hashing on the way out."""

from __future__ import annotations

import builtins
import contextlib
import io
import os
import shutil
import statistics
import time
from pathlib import Path

# (c): checkpoint sizes; each is RANKS shard files plus one RNG file per rank and `.metadata`,
# so only the bytes change from size to size, never the number of files.
COMMIT_SIZES = {"100 MB": 100_000_000, "1 GB": 1_000_000_000, "4 GB": 4_000_000_000}
RANKS = 8
CHUNK = 8 << 20


class _CountingFile:
    """A file object whose reads add to `counter` (everything else is the file's own)."""

    def __init__(self, raw, counter: list[int]) -> None:
        self._raw, self._counter = raw, counter

    def read(self, *args):
        data = self._raw.read(*args)
        self._counter[0] += len(data)
        return data

    def readinto(self, buffer):
        count = self._raw.readinto(buffer)
        self._counter[0] += count or 0
        return count

    def readline(self, *args):
        line = self._raw.readline(*args)
        self._counter[0] += len(line)
        return line

    def __iter__(self):
        return iter(self.readline, type(self.readline())())

    def __enter__(self):
        self._raw.__enter__()
        return self

    def __exit__(self, *exc):
        return self._raw.__exit__(*exc)

    def __getattr__(self, name: str):
        return getattr(self._raw, name)


@contextlib.contextmanager
def counted_checkpoint_reads(root: str):
    """[bytes] read meanwhile by this process from files below `root` other than commit
    records, through fsspec (what the store uses) or `open()`."""
    import fsspec

    counter = [0]
    fsspec_open, plain_open = fsspec.AbstractFileSystem.open, builtins.open

    def counted(path, mode, opened):
        name = str(path).split("://", 1)[-1]
        if "r" in str(mode) and name.startswith(root) and not name.endswith("/commit.json"):
            return _CountingFile(opened, counter)
        return opened

    def spy_fsspec(self, path, mode="rb", *args, **kwargs):
        opened = fsspec_open(self, path, mode, *args, **kwargs)
        protocols = self.protocol if isinstance(self.protocol, tuple) else (self.protocol,)
        # A local file is opened with open() underneath: counted there, once.
        return opened if "file" in protocols else counted(path, mode, opened)

    def spy_open(file, mode="r", *args, **kwargs):
        return counted(file, mode, plain_open(file, mode, *args, **kwargs))

    saved = (fsspec.AbstractFileSystem.open, builtins.open, io.open)
    fsspec.AbstractFileSystem.open, builtins.open, io.open = spy_fsspec, spy_open, spy_open
    try:
        yield counter
    finally:
        fsspec.AbstractFileSystem.open, builtins.open, io.open = saved


def _write_shards(
    directory: Path, total: int, block: bytes, hashed: bool, direct: bool = True
) -> tuple[dict, float, float]:
    """RANKS shard files of `total` bytes in all, written and fsynced one after another as a
    rank's DCP writer writes them (around the page cache, `checkpoint/direct_io.py`; or, with
    `direct=False`, through it), hashed on the way out or not; returns ({name: (size,
    checksum)} when hashed, seconds, kernel CPU seconds)."""
    from raytrain_dt.checkpoint.digests import HashingStream
    from raytrain_dt.checkpoint.direct_io import open_for_writing

    digests, seconds, kernel = {}, 0.0, 0.0
    for rank in range(RANKS):
        name = f"__{rank}_0.distcp"
        started, cpu = time.perf_counter(), os.times().system
        with open_for_writing(directory / name) if direct else open(directory / name, "wb") as raw:
            stream = HashingStream(raw) if hashed else raw
            view, left = memoryview(block), total // RANKS
            while left > 0:
                stream.write(view[: min(left, len(block))])
                left -= len(block)
            raw.flush()
            os.fsync(raw.fileno())
        seconds += time.perf_counter() - started
        kernel += os.times().system - cpu
        if hashed:
            digests[name] = (stream.size, stream.hexdigest())
    return digests, seconds, kernel


def _write_rank_files(step_dir: Path, total: int, block: bytes) -> dict[int, dict]:
    """A synthetic checkpoint as RANKS ranks write it, with what each reports: {rank: files}."""
    from raytrain_dt.checkpoint.digests import FileDigests

    (step_dir / "rng").mkdir(parents=True)
    shards, _, _ = _write_shards(step_dir, total, block, hashed=True)
    reports = {}
    for rank in range(RANKS):
        written = FileDigests()
        written.add(f"__{rank}_0.distcp", *shards[f"__{rank}_0.distcp"])
        rng = os.urandom(1600)
        (step_dir / "rng" / f"rank_{rank}.pt").write_bytes(rng)
        written.add_bytes(f"rng/rank_{rank}.pt", rng)
        if rank == 0:
            metadata = os.urandom(64_000)
            (step_dir / ".metadata").write_bytes(metadata)
            written.add_bytes(".metadata", metadata)
        reports[rank] = written.manifest()
    return reports


def bench_hashing(scratch: Path, block: bytes, repeats: int, sizes: dict) -> list[dict]:
    """Per size: the checksum alone (the one manifests record, and SHA-256 beside it), and the
    shards written plain and hashed, in turn, `repeats` times; the fastest of each (the host
    is shared: the others measure its other work)."""
    from raytrain_dt.checkpoint.digests import DIGEST, HASHERS

    cases = []
    for label, total in sizes.items():
        plain, hashed, cached = [], [], []  # (seconds, kernel CPU seconds) per write
        alone: dict[str, list[float]] = {DIGEST: [], "sha256": []}
        probe = scratch / "hashing"
        for _ in range(repeats):
            for kind, times in (("plain", plain), ("hashed", hashed), ("cached", cached)):
                probe.mkdir()
                os.sync()  # each write starts with nothing of the previous one to write back
                _, seconds, kernel = _write_shards(
                    probe, total, block, hashed=kind == "hashed", direct=kind != "cached"
                )
                times.append((seconds, kernel))
                shutil.rmtree(probe)
            for algorithm, times in alone.items():
                digest, started = HASHERS[algorithm](), time.perf_counter()
                for _ in range(max(1, total // len(block))):
                    digest.update(block)
                times.append(time.perf_counter() - started)
        mb = total / 1e6
        case = {
            "checkpoint": label,
            "repeats": repeats,
            f"{DIGEST}_MBps": round(mb / min(alone[DIGEST])),
            "sha256_MBps": round(mb / min(alone["sha256"])),
            "plain_write_MBps": round(mb / min(plain)[0]),
            "hashed_write_MBps": round(mb / min(hashed)[0]),
            "hashed_over_plain_write_time": round(min(hashed)[0] / min(plain)[0], 2),
            "kernel_cpu_s_per_GB_direct": round(min(k for _, k in plain) / mb * 1e3, 3),
            "page_cache_write_MBps": round(mb / min(cached)[0]),
            "kernel_cpu_s_per_GB_page_cache": round(min(k for _, k in cached) / mb * 1e3, 3),
        }
        cases.append(case)
        print(
            f"ranks' write of {label}: {case['plain_write_MBps']} MB/s plain, "
            f"{case['hashed_write_MBps']} MB/s hashed ({DIGEST} alone "
            f"{case[f'{DIGEST}_MBps']} MB/s, sha256 {case['sha256_MBps']} MB/s); kernel CPU "
            f"{case['kernel_cpu_s_per_GB_direct']} s/GB direct, "
            f"{case['kernel_cpu_s_per_GB_page_cache']} s/GB through the page cache "
            f"({case['page_cache_write_MBps']} MB/s); best of {repeats}"
        )
    return cases


def bench_commit(scratch: Path, repeats: int, sizes: dict) -> list[dict]:
    """Per size, the driver's commit: its time and the checkpoint bytes it read."""
    from raytrain_dt.checkpoint.digests import digest_tree
    from raytrain_dt.checkpoint.storage import Location
    from raytrain_dt.checkpoint.store import CheckpointStore, merge_manifests

    block = os.urandom(CHUNK)
    stores, reports = {}, {}
    for label, total in sizes.items():
        root = scratch / f"commit_{total}"
        stores[label] = CheckpointStore(str(root))
        reports[label] = _write_rank_files(root / "step_1", total, block)
    # The driver's commit runs elsewhere than the ranks' writes: timed on a quiet disk, the
    # sizes in turn so that the host's other work weighs on each alike.
    os.sync()
    times: dict[str, list[float]] = {label: [] for label in sizes}
    bytes_read = dict.fromkeys(sizes, 0)
    refs = {}
    for _ in range(repeats):
        for label, store in stores.items():
            with counted_checkpoint_reads(store.root.path) as read:
                started = time.perf_counter()
                refs[label] = store.commit(1, {"step": 1}, merge_manifests(reports[label]))
                times[label].append(time.perf_counter() - started)
            bytes_read[label] += read[0]
    commits = []
    for label, ref in refs.items():
        # The design this replaced: the driver listed the step and hashed every file itself
        # (its reads counted as the commit's are: the count is not blind).
        with counted_checkpoint_reads(stores[label].root.path) as hashed:
            started = time.perf_counter()
            digest_tree(ref.uri)
            driver_hash_s = time.perf_counter() - started
        shutil.rmtree(Location.parse(ref.uri).path.rsplit("/", 1)[0])
        median = statistics.median(times[label])
        commits.append(
            {
                "checkpoint": label,
                "bytes": sum(f["size"] for f in ref.record["files"].values()),
                "files": len(ref.record["files"]),
                "commit_median_ms": round(median * 1e3, 2),
                "commit_max_ms": round(max(times[label]) * 1e3, 2),
                "repeats": repeats,
                "driver_bytes_read": bytes_read[label],
                "driver_hashing_instead_s": round(driver_hash_s, 2),
                "driver_hashing_instead_bytes_read": hashed[0],
            }
        )
        print(
            f"commit {label}: median {median * 1e3:.2f} ms over {repeats}; checkpoint bytes "
            f"the driver read: {bytes_read[label]} (hashing it there instead: "
            f"{driver_hash_s:.2f} s)"
        )
    return commits


def commit_target_met(commits: list[dict]) -> bool:
    medians = [c["commit_median_ms"] for c in commits]
    return max(medians) <= 2 * min(medians) and all(c["driver_bytes_read"] == 0 for c in commits)


COMMIT_TABLE = (
    "Driver commit time by checkpoint size (target: largest median within 2x of the "
    "smallest, 0 checkpoint bytes read)"
)
HASHING_TABLE = (
    "Ranks' writes: the same shards written and fsynced one after another as DCP writes them "
    "(around the page cache), hashed on the way out (XXH3-128) or not, and written through "
    "the page cache for comparison (its kernel CPU with free memory; once the cache is full, "
    "reclaim adds to it); fastest of the repeats"
)
