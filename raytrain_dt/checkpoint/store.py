"""The checkpoint store of one run: naming, atomic commit, verification, fallback, retention.

Ranks write their shards into `<root>/step_<N>/`. A checkpoint exists only once the
coordinator has written `<root>/step_<N>/commit.json` after every rank reported its shards
written: the record holds the train state and a manifest of every file with its size and
SHA-256. Loading verifies the manifest; a damaged or uncommitted checkpoint is never loaded,
and resume falls back to the previous committed one with a warning naming what was wrong.
No torch here: the coordinator and the CLI use it.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from raytrain_dt.checkpoint.storage import Location

log = logging.getLogger(__name__)

COMMIT_FILE = "commit.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass(frozen=True)
class CheckpointRef:
    uri: str
    step: int
    committed: bool
    record: dict  # the commit record ({} when uncommitted)

    @property
    def train_state(self) -> dict:
        return self.record.get("train_state", {})

    @property
    def consumed_samples(self) -> int:
        return self.train_state.get("consumed_samples", 0)

    @property
    def path(self) -> str:
        return self.uri


class CheckpointStore:
    def __init__(self, root_uri: str):
        self.root = Location.parse(root_uri)

    def step_uri(self, step: int) -> str:
        return self.root.child(f"step_{step}").uri

    # --- listing -----------------------------------------------------------------------------
    def list(self) -> list[CheckpointRef]:
        """Every step directory, committed or not, oldest first."""
        if not self.root.exists():
            return []
        refs = []
        for entry in self.root.fs.ls(self.root.path, detail=False):
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            match = _STEP_DIR.match(name)
            if not match:
                continue
            loc = self.root.child(name)
            commit = loc.child(COMMIT_FILE)
            record = commit.read_json() if commit.exists() else {}
            refs.append(CheckpointRef(loc.uri, int(match.group(1)), bool(record), record))
        return sorted(refs, key=lambda r: r.step)

    def committed(self) -> list[CheckpointRef]:
        return [r for r in self.list() if r.committed]

    # --- commit ------------------------------------------------------------------------------
    def commit(self, step: int, train_state: dict) -> CheckpointRef:
        """Record the files now under step_<N> as checkpoint N. Call only after every rank
        reported its shards written."""
        loc = self.root.child(f"step_{step}")
        sizes = loc.files()
        sizes.pop(COMMIT_FILE, None)
        if not sizes:
            raise FileNotFoundError(f"{loc.uri}: no files to commit")
        manifest = {
            name: {"size": size, "sha256": loc.sha256(name)} for name, size in sorted(sizes.items())
        }
        record = {"step": step, "train_state": train_state, "files": manifest}
        loc.child(COMMIT_FILE).write_json_atomic(record)
        return CheckpointRef(loc.uri, step, True, record)

    # --- verification ------------------------------------------------------------------------
    def problems(self, ref: CheckpointRef, checksums: bool = True) -> list[str]:
        """What is wrong with a checkpoint; empty when it is committed and intact."""
        if not ref.committed:
            return [f"{ref.uri}: not committed (no {COMMIT_FILE})"]
        loc = Location.parse(ref.uri)
        present = loc.files()
        found = []
        for name, expected in ref.record["files"].items():
            if name not in present:
                found.append(f"{ref.uri}/{name}: missing")
            elif present[name] != expected["size"]:
                found.append(
                    f"{ref.uri}/{name}: size {present[name]} != {expected['size']} recorded"
                )
            elif checksums and loc.sha256(name) != expected["sha256"]:
                found.append(f"{ref.uri}/{name}: checksum mismatch")
        return found

    def latest_valid(self) -> CheckpointRef | None:
        """The newest committed, intact checkpoint; warns about each newer one it skips."""
        for ref in reversed(self.list()):
            problems = self.problems(ref)
            if not problems:
                return ref
            if ref.committed:  # uncommitted ones are in-flight or abandoned saves, not damage
                log.warning("skipping checkpoint step %d: %s", ref.step, "; ".join(problems))
        return None

    # --- retention ---------------------------------------------------------------------------
    def prune(
        self, keep_last: int, keep_every: int = 0, in_flight: set[int] | None = None
    ) -> list[str]:
        """Delete committed checkpoints beyond the newest `keep_last` (keeping every
        `keep_every`-th step), and abandoned uncommitted ones older than the newest commit.
        Never touches the newest committed checkpoint or a step being written."""
        in_flight = in_flight or set()
        refs = self.list()
        committed = [r for r in refs if r.committed]
        if not committed:
            return []
        newest = committed[-1].step
        keep = {r.step for r in committed[-max(1, keep_last) :]} | {newest} | in_flight
        if keep_every:
            keep |= {r.step for r in committed if r.step % keep_every == 0}
        doomed = [r for r in refs if r.step not in keep and (r.committed or r.step < newest)]
        for ref in doomed:
            Location.parse(ref.uri).remove()
        return [r.uri for r in doomed]
