"""DeepSpeed checkpoint files: the layout that wrote them, and their layout-free conversion.

A DeepSpeed checkpoint directory holds, per pipeline stage s ("model parallel" rank s to
DeepSpeed), `mp_rank_<s>_model_states.pt` and one `..._mp_rank_<s>_optim_states.pt` ZeRO
partition per DP rank (ZeRO-3 names its model states per DP rank instead, and is never
pipelined here). Every stage's files name parameters as the unsplit model does.

DeepSpeed's loader needs the layout that wrote a checkpoint; another DP size or pipeline split
goes through its universal format (per-parameter fp32 weights and Adam moments). Its converter
merges pipeline stages only for its own PipelineModule's layer files, so a pipeline checkpoint
is converted stage by stage, each as the 1-stage checkpoint it is, and the results merged:
disjoint parameter directories, and one model-states file with every stage's weights.

`DeepSpeedTensors` reads a checkpoint's full fp32 weights by name for `ckpt consolidate`
(a `checkpoint.export.TensorSource`) with DeepSpeed's own reader, which knows every ZeRO
stage's partitioning (`get_fp32_state_dict_from_zero_checkpoint`), again stage by stage.

`recording_saves` hashes what a rank writes in a save for the commit's manifest: each file
DeepSpeed's checkpoint engine writes (torch.save) is hashed by the writing rank right after it
is written, and global rank 0, which alone writes DeepSpeed's side files beside the tag
directory (`latest`, the recovery scripts), hashes those.

DeepSpeed reads and writes its files with torch.save/torch.load on local paths. For a step
directory on object storage (`s3://`), `StagedStep` gives each rank a node-local staging
directory of its own: a save writes there and the rank uploads exactly the files it wrote (their
digests are those of the local copies, the same bytes); a load mirrors the step's listing there
as empty placeholders (DeepSpeed globs and counts the files of a layout) and fetches a file's
bytes only when this rank's load opens it (`fetching_loads`), so each rank downloads only its
own shards. Checkpoint bytes never pass through the driver.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import torch

from raytrain_dt.checkpoint.digests import FileDigests
from raytrain_dt.checkpoint.storage import Location
from raytrain_dt.checkpoint.store import COMMIT_FILE

log = logging.getLogger("raytrain_dt.deepspeed")

MODEL_STATES = "mp_rank_{stage:02d}_model_states.pt"


@contextlib.contextmanager
def recording_saves(
    ds_engine, step_dir: Path, digests: FileDigests, writes_side_files: bool
) -> Iterator[None]:
    """While DeepSpeed's `save_checkpoint(step_dir, ...)` runs inside: record in `digests`
    (names relative to `step_dir`) every file this rank's checkpoint engine writes, and on
    exit, where `writes_side_files` (global rank 0), the files beside the tag directory."""
    checkpoint_engine = ds_engine.checkpoint_engine
    save = checkpoint_engine.save
    step = Location.parse(str(step_dir))

    def save_and_record(state_dict, path):
        save(state_dict, path)
        # Just written by this process: hashed from the page cache, not the storage.
        digests.add_stored(step, Path(path).relative_to(step_dir).as_posix())

    checkpoint_engine.save = save_and_record
    try:
        yield
    finally:
        del checkpoint_engine.save  # the class's method again
    if writes_side_files:
        for side in sorted(p for p in step_dir.iterdir() if p.is_file()):
            if not side.name.startswith(COMMIT_FILE):  # an earlier commit of this step's
                digests.add_stored(step, side.name)


class StagedStep:
    """A step directory as DeepSpeed sees it: `local`, a local directory. For a local step
    directory that is the directory itself, with nothing to upload or fetch; for object storage
    it is a fresh staging directory on this node's disk (under TMPDIR), removed by `close`."""

    def __init__(self, uri: str) -> None:
        loc = Location.parse(uri)
        self.remote = None if loc.is_local else loc
        if self.remote is None:
            self.local = Path(loc.path)
        else:
            self.local = Path(tempfile.mkdtemp(prefix="raytrain_dt-deepspeed-"))
        self._placeholders: set[str] = set()  # mirrored names whose bytes are not here yet

    def __enter__(self) -> StagedStep:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.remote is not None:
            shutil.rmtree(self.local, ignore_errors=True)

    def upload(self, under: str = "", last: str | None = None) -> None:
        """Upload every file staged below `under` (all: this rank's whole save) to the step;
        `last` (a name below `under`) after all others, so that its presence means the rest
        are there."""
        if self.remote is None:
            return
        root = self.local / under
        files = sorted(p for p in root.rglob("*") if p.is_file())
        for path in sorted(files, key=lambda p: last is not None and p == root / last):
            name = path.relative_to(self.local).as_posix()
            if name in self._placeholders:
                continue  # mirrored, never fetched: not ours to write
            # Object stores have no directories to make: one PUT per file.
            self.remote.fs.put_file(str(path), self.remote.child(name).path)

    def mirror(self, under: str, complete: str | None = None) -> bool:
        """Mirror the names of the step's files below `under` as empty placeholders, fetched
        on demand (`fetch`); whether there are any (with `complete`: whether that name, which
        `upload` sent last, is among them)."""
        if self.remote is None:
            return (self.local / under / (complete or "")).exists()
        names = self.remote.child(under).files()
        for name in names:
            full = f"{under}/{name}"
            path = self.local / full
            if path.exists():
                continue  # staged by this rank (a conversion it just ran)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
            self._placeholders.add(full)
        return complete in names if complete is not None else bool(names)

    def fetch(self, path: str | os.PathLike) -> Path:
        """`path` (below `local`) with its bytes here, downloaded if it is a placeholder."""
        path = Path(path)
        if self.remote is None:
            return path
        name = path.relative_to(self.local).as_posix() if path.is_absolute() else str(path)
        if name in self._placeholders:
            self.remote.fs.get_file(self.remote.child(name).path, str(self.local / name))
            self._placeholders.discard(name)
        return self.local / name

    def clear(self, under: str) -> None:
        """Drop what is staged below `under` (fetched or mirrored), to be written afresh."""
        shutil.rmtree(self.local / under, ignore_errors=True)
        self._placeholders = {n for n in self._placeholders if not n.startswith(under + "/")}

    def fetch_all(self, under: str) -> None:
        for name in sorted(n for n in self._placeholders if n.startswith(under + "/")):
            self.fetch(name)


@contextlib.contextmanager
def fetching_loads(ds_engine, staged: StagedStep) -> Iterator[None]:
    """While DeepSpeed's `load_checkpoint` runs inside: each file its checkpoint engine opens
    is fetched into `staged` first, so this rank downloads only what its load reads."""
    checkpoint_engine = ds_engine.checkpoint_engine
    load = checkpoint_engine.load

    def fetch_and_load(path, map_location=None):
        return load(str(staged.fetch(path)), map_location=map_location)

    checkpoint_engine.load = fetch_and_load
    try:
        yield
    finally:
        del checkpoint_engine.load  # the class's method again


def saved_layout(tag_dir: Path) -> tuple[int, bool, int] | None:
    """(DP size, is ZeRO-3, pipeline stages) a checkpoint was written with; None for ZeRO-0
    (replicated states load at any DP size). Read from DeepSpeed's file names."""
    # Stage 0's partitions: a pipeline checkpoint has one set per stage.
    partitions = list(tag_dir.glob("*_mp_rank_00_optim_states.pt"))
    if not partitions:
        return None
    zero3 = any(tag_dir.glob("zero_pp_rank_*_model_states.pt"))
    # ZeRO-3 names its model states per DP rank, not per stage: it counts as one stage.
    stages = len(list(tag_dir.glob("mp_rank_*_model_states.pt"))) or 1
    return len(partitions), zero3, stages


def to_universal(tag_dir: Path, out_dir: Path) -> None:
    """Write the universal form of the checkpoint in `tag_dir` to `out_dir` (atomically)."""
    stages = (saved_layout(tag_dir) or (1, False, 1))[2]
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=".universal-") as tmp:
        work = Path(tmp)
        if stages == 1:
            _convert(tag_dir, work / "out")
        else:
            _convert_stages(tag_dir, stages, work)
        (work / "out").rename(out_dir)


def _convert_stages(tag_dir: Path, stages: int, work: Path) -> None:
    merged = work / "out"
    model_states: dict = {}
    for stage in range(stages):
        alone = stage_alone(tag_dir, stage, work / f"stage{stage}")
        converted = work / f"converted{stage}"
        _convert(alone, converted)
        # Parameter directories are disjoint across stages; the common optimizer state
        # (hyperparameters, which the engine sets from our config anyway) is stage 0's.
        shutil.copytree(converted / "zero", merged / "zero", dirs_exist_ok=True)
        states = torch.load(converted / MODEL_STATES.format(stage=0), weights_only=False)
        _merge_model_states(model_states, states)
    # One file for the whole model: DeepSpeed checks the file count against this.
    model_states["mp_world_size"] = 1
    torch.save(model_states, merged / MODEL_STATES.format(stage=0))


def stage_alone(tag_dir: Path, stage: int, out_dir: Path) -> Path:
    """`out_dir` holding links to one pipeline stage's files under stage 0's names: the 1-stage
    checkpoint that DeepSpeed's readers, which know no stages, take it for."""
    out_dir.mkdir()
    marker = f"mp_rank_{stage:02d}"
    for f in tag_dir.glob(f"*{marker}_*.pt"):
        (out_dir / re.sub(marker, "mp_rank_00", f.name)).symlink_to(f.resolve())
    return out_dir


class DeepSpeedTensors:
    """A DeepSpeed checkpoint's full fp32 weights by name (the whole model: every pipeline
    stage's), read with DeepSpeed's reader in its lazy mode.

    Memory is the library's: at ZeRO-3 each weight is gathered from the memory-mapped partition
    files when it is streamed, at ZeRO-1/2 the reader concatenates the partitions of each
    parameter group, about one fp32 copy of the model. ZeRO-0 has no partitions: its
    model-states files hold the weights themselves, memory-mapped and read one at a time.
    """

    def __init__(self, tag_dir: Path):
        layout = saved_layout(tag_dir)
        if layout is None:
            self._lazy = {}
            for f in sorted(tag_dir.glob("mp_rank_*_model_states.pt")):
                states = torch.load(f, map_location="cpu", mmap=True, weights_only=False)
                self._lazy.update(states["module"])
        else:
            self._lazy = self._zero_weights(tag_dir, layout[2])
        if not self._lazy:
            raise ValueError(f"{tag_dir}: no DeepSpeed model states")
        self.tensors = {name: (torch.Size(t.shape), t.dtype) for name, t in self._lazy.items()}

    @staticmethod
    def _zero_weights(tag_dir: Path, stages: int) -> dict:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        weights: dict = {}
        # The reader prints its progress; stdout is the command's own output.
        with (
            tempfile.TemporaryDirectory(prefix="ds-stages-") as tmp,
            contextlib.redirect_stdout(sys.stderr),
        ):
            for stage in range(stages):
                # The reader takes every `*_model_states.pt` for one stage's DP ranks.
                alone = (
                    tag_dir if stages == 1 else stage_alone(tag_dir, stage, Path(tmp, str(stage)))
                )
                # Disjoint names across stages; the reader has opened (mapped) the files it
                # needs before it returns, so the links may go afterwards.
                weights.update(
                    get_fp32_state_dict_from_zero_checkpoint(
                        str(alone.parent), tag=alone.name, lazy_mode=True
                    )
                )
        return weights

    def stream(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        for name in names:
            # A lazy (ZeRO-3) weight is gathered here, a ZeRO-1/2 one is a view of its group.
            yield name, self._lazy[name].contiguous()


def _merge_model_states(into: dict, states: dict) -> None:
    """One model-states dict holding every stage's weights and parameter shapes."""
    if not into:
        into.update(states)
        into["module"] = dict(states["module"])
        into["param_shapes"] = [dict(group) for group in states["param_shapes"]]
        return
    into["module"].update(states["module"])
    for group, more in zip(into["param_shapes"], states["param_shapes"], strict=True):
        group.update(more)


def _convert(input_dir: Path, output_dir: Path) -> None:
    from deepspeed.checkpoint import ds_to_universal

    log.info("converting %s to a universal checkpoint", input_dir)
    args = SimpleNamespace(
        input_folder=str(input_dir),
        output_folder=str(output_dir),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        # ZeRO-1/2 checkpoints lack state the converter expects; ZeRO-3 ones have it.
        inject_missing_state=True,
    )
    ds_to_universal.main(args)
