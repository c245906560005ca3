"""DCP checkpoints held in host memory: a writer whose files are bytes in a dict, and a reader
that sees several ranks' separately written copies as one checkpoint.

An in-memory copy is taken by each rank alone (`dcp.save(..., no_dist=True)`): no collective,
so a rank can copy, skip or fail a copy without its peers waiting on it, and a copy never
shares a process group with training or with the durable save. Each copy is a complete DCP
checkpoint of that rank's shards (its own `.metadata` names only its chunks, with their global
offsets). `CopyReader` merges the owners' metadata into one (chunks of replicated tensors
once, every file path prefixed with its owner), so DCP's load planner reshards the union onto
any new layout exactly as it reshards a durable checkpoint. The bytes come from `fetch(owner,
name)`: the caller decides where each owner's files are (this process, or a peer holding them).

A copy is written packed: its tensors as DCP items under the same keys a durable checkpoint
uses, and every other leaf (the optimizer's hyperparameters, which a flattened optimizer state
dict repeats for every parameter: 11 of them for AdamW, and its 0-dim step counts) as one item
per owner. DCP serialises
each item on its own with `torch.save`; unpacked, a copy of the tiny preset was 585 items of
which 429 were those hyperparameters, and the copy cost more than the step it hid behind.
`load_packed` reads it back into a state dict of the usual shape.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import pickle
import posixpath
from collections.abc import Callable, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemBase
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

METADATA = ".metadata"
# The item holding one owner's non-tensor leaves: `__objects__.<owner rank>`.
OBJECTS_PREFIX = "__objects__."

Fetch = Callable[[int, str], bytes]  # (owner rank, file name) -> the file's bytes


class _DictFiles(FileSystemBase):
    """DCP's filesystem interface over a dict of name -> bytes (writes land on close)."""

    def __init__(self, files: dict[str, bytes]):
        self.files = files

    @contextlib.contextmanager
    def create_stream(self, path, mode: str) -> Iterator[io.BytesIO]:
        if "w" in mode:
            buffer = _KeptOnClose(self.files, str(path))
            yield buffer
            buffer.close()  # DCP's writer may have closed it already
        else:
            yield io.BytesIO(self.files[str(path)])

    def concat_path(self, path, suffix: str) -> str:
        return posixpath.join(str(path), suffix) if str(path) else suffix

    def init_path(self, path) -> str:
        return str(path)

    def rename(self, path, new_path) -> None:
        self.files[str(new_path)] = self.files.pop(str(path))

    def mkdir(self, path) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False

    def exists(self, path) -> bool:
        return str(path) in self.files

    def rm_file(self, path) -> None:
        self.files.pop(str(path), None)


class _KeptOnClose(io.BytesIO):
    """A write buffer whose bytes land in `files[name]` when it is closed."""

    def __init__(self, files: dict[str, bytes], name: str):
        super().__init__()
        self._files, self._name = files, name

    def close(self) -> None:
        if not self.closed:
            self._files[self._name] = self.getvalue()
        super().close()


def save_to_memory(state_dict: dict, owner: int) -> dict[str, bytes]:
    """Rank `owner`'s shards of `state_dict` as a packed DCP checkpoint in memory (no
    collective)."""
    flat, _ = flatten_state_dict(state_dict)
    packed = {k: v for k, v in flat.items() if _is_item(v)}
    packed[f"{OBJECTS_PREFIX}{owner}"] = {k: v for k, v in flat.items() if not _is_item(v)}
    files: dict[str, bytes] = {}
    writer = FileSystemWriter("", sync_files=False)
    writer.fs, writer.path = _DictFiles(files), ""
    planner = DefaultSavePlanner(flatten_state_dict=False)  # the objects' dict stays one item
    dcp.save(packed, storage_writer=writer, planner=planner, no_dist=True)
    return files


def load_packed(state_dict: dict, reader: CopyReader) -> dict:
    """Load copies written by `save_to_memory` into `state_dict` (resharded, as `dcp.load`):
    tensors in place; returns the state dict with the saved non-tensor leaves put back."""
    flat, mapping = flatten_state_dict(state_dict)
    packed: dict = {k: v for k, v in flat.items() if _is_item(v)}
    object_keys = [
        k for k in reader.read_metadata().state_dict_metadata if k.startswith(OBJECTS_PREFIX)
    ]
    packed.update(dict.fromkeys(object_keys))  # placeholders: read as bytes items
    planner = _PackedLoadPlanner()
    dcp.load(packed, storage_reader=reader, planner=planner)
    saved = planner.objects  # every owner's (a pipeline stage's own parameters, say)
    missing = [k for k, v in flat.items() if not _is_item(v) and k not in saved]
    if missing:
        raise ValueError(f"in-memory copies lack {len(missing)} entries, e.g. {missing[0]}")
    flat.update({k: saved[k] for k, v in flat.items() if not _is_item(v)})
    return unflatten_state_dict(flat, mapping)


class _PackedLoadPlanner(DefaultLoadPlanner):
    """Collects the owners' packed non-tensor leaves (`dcp.load` hands a plain value back
    only into a dict of its own, not the caller's)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False)
        self.objects: dict = {}

    def load_bytes(self, read_item, value) -> None:
        self.objects.update(torch.load(value, weights_only=False))


def _is_item(value) -> bool:
    """A leaf written as a DCP item of its own (resharded on load): a tensor with dimensions."""
    return isinstance(value, torch.Tensor) and value.dim() > 0


class _OwnersFiles(FileSystemBase):
    """Read-only files named `<owner>/<name>`, fetched once each and kept for the load."""

    def __init__(self, fetch: Fetch):
        self.fetch = fetch
        self.cache: dict[str, bytes] = {}

    @contextlib.contextmanager
    def create_stream(self, path, mode: str) -> Iterator[io.BytesIO]:
        path = str(path)
        if path not in self.cache:
            owner, name = path.split("/", 1)
            self.cache[path] = self.fetch(int(owner), name)
        yield io.BytesIO(self.cache[path])

    def concat_path(self, path, suffix: str) -> str:
        return posixpath.join(str(path), suffix) if str(path) else suffix

    def init_path(self, path) -> str:
        return str(path)

    def rename(self, path, new_path) -> None:
        raise NotImplementedError("in-memory copies are read-only here")

    def mkdir(self, path) -> None:
        raise NotImplementedError("in-memory copies are read-only here")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False

    def exists(self, path) -> bool:
        return True

    def rm_file(self, path) -> None:
        raise NotImplementedError("in-memory copies are read-only here")


class CopyReader(FileSystemReader):
    """One DCP checkpoint read from the in-memory copies of `owners` (the ranks that wrote
    it). Each owner's `.metadata` is fetched once; a data file only when a read needs it."""

    def __init__(self, owners: list[int], fetch: Fetch):
        super().__init__("")
        self.fs, self.path = _OwnersFiles(fetch), ""
        self.owners = owners
        self._metadata: Metadata | None = None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self._metadata is None:
            per_owner = {}
            for owner in self.owners:
                with self.fs.create_stream(f"{owner}/{METADATA}", "rb") as stream:
                    per_owner[owner] = pickle.load(stream)
            self._metadata = merge_metadata(per_owner)
        return self._metadata

    def bytes_of(self, owner: int, name: str) -> bytes:
        """A file of the copy other than DCP's (the owner's RNG state)."""
        with self.fs.create_stream(f"{owner}/{name}", "rb") as stream:
            return stream.getvalue()


def merge_metadata(per_owner: dict[int, Metadata]) -> Metadata:
    """One checkpoint's metadata from several ranks' own: every distinct chunk once (a
    replicated tensor's copies are one chunk), its storage path prefixed with its owner."""
    tensors: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    storage: dict[MetadataIndex, object] = {}
    planner_data: dict = {}
    for owner, metadata in sorted(per_owner.items()):
        planner_data.update(metadata.planner_data or {})

        def relocated(index: MetadataIndex, owner: int = owner, metadata: Metadata = metadata):
            info = metadata.storage_data[index]
            return dataclasses.replace(info, relative_path=f"{owner}/{info.relative_path}")

        for fqn, entry in metadata.state_dict_metadata.items():
            if isinstance(entry, BytesStorageMetadata):
                if fqn not in tensors:
                    tensors[fqn] = entry
                    storage[MetadataIndex(fqn)] = relocated(MetadataIndex(fqn))
                continue
            merged = tensors.setdefault(
                fqn, TensorStorageMetadata(entry.properties, entry.size, [])
            )
            seen = {(tuple(c.offsets), tuple(c.sizes)) for c in merged.chunks}
            for chunk in entry.chunks:
                if (tuple(chunk.offsets), tuple(chunk.sizes)) in seen:
                    continue
                if torch.Size(chunk.sizes).numel() == 0 and len(chunk.sizes) > 0:
                    continue  # an empty shard of an uneven layout holds nothing to read
                index = MetadataIndex(fqn, chunk.offsets, len(merged.chunks))
                merged.chunks.append(chunk)
                storage[index] = relocated(MetadataIndex(fqn, chunk.offsets))
    return Metadata(state_dict_metadata=tensors, planner_data=planner_data, storage_data=storage)
