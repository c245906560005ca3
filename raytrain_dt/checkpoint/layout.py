"""Where checkpoints live in a run and how they are found. No torch: the coordinator uses it.

`<root>/step_<N>/` holds the engine's shards plus `train_state.json`, which rank 0 writes only
after every rank's shards are on disk; a directory without it is an unfinished save and is
never resumed from.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

TRAIN_STATE = "train_state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass(frozen=True)
class CheckpointRef:
    path: str
    step: int
    consumed_samples: int
    state: dict


def checkpoint_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step}"


def list_checkpoints(root: str | Path) -> list[CheckpointRef]:
    """Complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        state_file = child / TRAIN_STATE
        if match and state_file.is_file():
            state = json.loads(state_file.read_text())
            found.append(
                CheckpointRef(str(child), int(match.group(1)), state["consumed_samples"], state)
            )
    return sorted(found, key=lambda ref: ref.step)


def latest_checkpoint(root: str | Path) -> CheckpointRef | None:
    refs = list_checkpoints(root)
    return refs[-1] if refs else None


def write_train_state(path: str | Path, state: dict) -> None:
    target = Path(path) / TRAIN_STATE
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True))
    tmp.replace(target)  # atomic on POSIX: the file is either absent or complete


def prune(root: str | Path, keep_last: int) -> list[str]:
    """Delete all but the newest `keep_last` complete checkpoints; returns what was deleted."""
    import shutil

    refs = list_checkpoints(root)
    doomed = refs[:-keep_last] if keep_last > 0 else []
    for ref in doomed:
        shutil.rmtree(ref.path, ignore_errors=True)
    return [ref.path for ref in doomed]
