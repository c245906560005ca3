"""Checkpoint storage by URI: a local path, `file://` or `s3://`, through fsspec.

Everything the checkpoint code reads or writes goes through here, so a run directory on S3
uses the same commit, verify and retention code as one on local disk. DCP gets a matching
writer/reader: the plain filesystem one for local paths (fastest), fsspec's otherwise; the
writer can hash what it writes (`digests.py`).
"""

from __future__ import annotations

import json
import posixpath
import uuid
from dataclasses import dataclass

import fsspec
from fsspec.core import url_to_fs


@dataclass(frozen=True)
class Location:
    fs: fsspec.AbstractFileSystem
    path: str  # without the scheme, as the filesystem wants it
    uri: str

    @classmethod
    def parse(cls, uri: str) -> Location:
        fs, path = url_to_fs(str(uri))
        return cls(fs, path, str(uri))

    @property
    def is_local(self) -> bool:
        return "file" in (
            self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        )

    def child(self, *parts: str) -> Location:
        joined_path = posixpath.join(self.path, *parts)
        joined_uri = self.uri.rstrip("/") + "/" + "/".join(parts)
        return Location(self.fs, joined_path, joined_uri)

    def exists(self) -> bool:
        self.fs.invalidate_cache(self.path)
        return self.fs.exists(self.path)

    def read_json(self) -> dict:
        with self.fs.open(self.path, "r") as f:
            return json.load(f)

    def write_json_atomic(self, record: dict) -> None:
        """Write-then-rename where the filesystem can rename atomically (local, HDFS); S3 PUTs
        of one object are atomic on their own."""
        text = json.dumps(record, indent=2, sort_keys=True)
        if self.is_local:
            tmp = self.path + ".tmp"
            with self.fs.open(tmp, "w") as f:
                f.write(text)
            self.fs.mv(tmp, self.path)
        else:
            with self.fs.open(self.path, "w") as f:
                f.write(text)

    def files(self) -> dict[str, int]:
        """Relative path -> size of every file below this location."""
        # Object stores' listings are cached per process (s3fs's dircache); other processes
        # (the ranks) write here, so always list afresh.
        self.fs.invalidate_cache(self.path)
        if not self.fs.exists(self.path):
            return {}
        found = self.fs.find(self.path, detail=True)
        return {
            posixpath.relpath(name, self.path): int(info["size"])
            for name, info in found.items()
            if info.get("type") == "file"
        }

    def remove(self) -> None:
        if self.fs.exists(self.path):
            self.fs.rm(self.path, recursive=True)

    def makedirs(self) -> None:
        self.fs.makedirs(self.path, exist_ok=True)


def dcp_writer(uri: str, digests=None):
    """DCP's writer for `uri`; with `digests` (a `digests.FileDigests`), every file it writes
    is hashed as it is written and recorded there."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    from raytrain_dt.checkpoint.digests import DigestingFileSystem
    from raytrain_dt.checkpoint.direct_io import DirectFileSystem

    loc = Location.parse(uri)
    if loc.is_local:
        writer = FileSystemWriter(loc.path)
        writer.fs = DirectFileSystem()  # around the page cache (`checkpoint/direct_io.py`)
    else:
        writer = FsspecWriter(uri)
    if digests is not None:
        writer.fs = DigestingFileSystem(writer, digests)
    return writer


def save_planner(key: str):
    """DCP's default save planner, with its plans cached under `key`. A later save under the
    same key sends no plans between the ranks, and the coordinator builds no global plan: DCP
    pickles and unpickles one write item per tensor shard for each, which a background write
    does under the GIL, taken from the training thread (on a GPU, the thread that launches its
    kernels).

    torch keeps the caches in its process, and a rank whose local plan equals the one it cached
    sends none: the coordinator must then hold that rank's plan under the same key. That holds
    only for saves among the same ranks, so the key must be one process group's own, never a
    layout's: an actor kept into a new formation, or a warm one in another run, would otherwise
    send nothing to a coordinator that never saw its plan. `new_plan_key` makes one per engine,
    and `forget_save_plans` drops it with the engine.
    """
    from torch.distributed.checkpoint import DefaultSavePlanner

    planner = DefaultSavePlanner(enable_plan_caching=True)
    planner._cached_plans_key = key  # torch keys its cache by the planner's class name
    return planner


def new_plan_key(layout_description: str) -> str:
    """A key for `save_planner`, unique to one engine (one process group)."""
    return f"raytrain_dt {layout_description} {uuid.uuid4().hex}"


def forget_save_plans(key: str) -> None:
    """Drop what DCP cached under `key` (its engine is gone)."""
    from torch.distributed.checkpoint.planner import SavePlanner

    for name in (
        "_cached_save_plan",
        "_cached_final_save_plan",
        "_cached_all_plans",
        "_cached_global_plan",
        "_cached_metadata",
    ):
        getattr(SavePlanner, name, {}).pop(key, None)


def dcp_reader(uri: str):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    loc = Location.parse(uri)
    return FileSystemReader(loc.path) if loc.is_local else FsspecReader(uri)
