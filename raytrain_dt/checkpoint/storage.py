"""Checkpoint storage by URI: a local path, `file://` or `s3://`, through fsspec.

Everything the checkpoint code reads or writes goes through here, so a run directory on S3
uses the same commit, verify and retention code as one on local disk. DCP gets a matching
writer/reader: the plain filesystem one for local paths (fastest), fsspec's otherwise; the
writer can hash what it writes (`digests.py`).
"""

from __future__ import annotations

import json
import posixpath
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


def save_planner(layout_key: str):
    """DCP's default save planner, with its plans cached under `layout_key` (a layout's
    description: the same key, the same shards on every rank). A later save of the same
    layout sends no plans between the ranks, and the coordinator builds no global plan: DCP
    pickles and unpickles one write item per tensor shard for each, which a background write
    does under the GIL, taken from the training thread (on a GPU, the thread that launches its
    kernels). A rank whose plan differs from its cached one still sends it, and the
    coordinator merges it in."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    planner = DefaultSavePlanner(enable_plan_caching=True)
    planner._cached_plans_key = f"raytrain_dt:{layout_key}"  # torch keys its cache by class
    return planner


def dcp_reader(uri: str):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    loc = Location.parse(uri)
    return FileSystemReader(loc.path) if loc.is_local else FsspecReader(uri)
