"""Read back what W&B wrote for a run: its `.wandb` file (records in W&B's append-only log
format, each a `wandb_internal_pb2.Record`), which is what `wandb sync` uploads.

The format: a 7-byte header (`:W&B`, magic 0xBEE1, version), then 32 KiB blocks of chunks,
each with a 7-byte header (CRC32, length, type: 1 full, 2 first, 3 middle, 4 last); a block
whose tail is too short for a chunk header is padded with zeros.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

BLOCK = 32 * 1024
HEADER = struct.Struct("<4sHB")
CHUNK = struct.Struct("<IHB")
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


@dataclass
class WandbRun:
    name: str = ""
    project: str = ""
    config: dict = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    exit_code: int | None = None


def records(path: Path):
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, _version = HEADER.unpack_from(data)
    assert (ident, magic) == (b":W&B", 0xBEE1), f"{path} is not a W&B run file"
    pos, pending = HEADER.size, b""
    while pos + CHUNK.size <= len(data):
        if BLOCK - pos % BLOCK < CHUNK.size:
            pos += BLOCK - pos % BLOCK  # the block's padding
            continue
        _crc, length, kind = CHUNK.unpack_from(data, pos)
        pos += CHUNK.size
        if kind == 0:  # zeros: the end of what was written
            break
        pending += data[pos : pos + length]
        pos += length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _key(item) -> list[str]:
    return list(item.nested_key) or [item.key]


def _set(tree: dict, path: list[str], value) -> None:
    for part in path[:-1]:
        tree = tree.setdefault(part, {})
    tree[path[-1]] = value


def read_wandb_run(path: Path) -> WandbRun:
    run = WandbRun()
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.name, run.project = record.run.display_name, record.run.project
            for item in record.run.config.update:
                run.config[item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                _set(run.config, _key(item), json.loads(item.value_json))
        elif kind == "history":
            row: dict = {}
            for item in record.history.item:
                _set(row, _key(item), json.loads(item.value_json))
            run.history.append(row)
        elif kind == "summary":
            for item in record.summary.update:
                _set(run.summary, _key(item), json.loads(item.value_json))
        elif kind == "exit":
            run.exit_code = record.exit.exit_code
    return run
