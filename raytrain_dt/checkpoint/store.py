"""The checkpoint store of one run: naming, atomic commit, damage checks, fallback, retention.

Ranks write their shards into `<root>/step_<N>/`. A checkpoint exists only once the
coordinator has written `<root>/step_<N>/commit.json` after every rank reported its shards
written: the record holds the train state and a manifest of every file with its size and
SHA-256, merged from the ranks' reports (each rank hashed what it wrote, `digests.py`). Nothing
here reads a checkpoint byte: the commit checks the reports against a listing (names and
sizes), and so does `latest_valid`; the ranks verify the checksums before a load and the
coordinator marks what they found (`mark_damaged`). A damaged or uncommitted checkpoint is
never loaded, and resume falls back to the previous committed one with a warning naming what
was wrong. No torch here: the coordinator and the CLI use it.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from raytrain_dt.checkpoint.storage import Location
from raytrain_dt.errors import CheckpointError

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
        # Steps the ranks found damaged (what they found), skipped until committed anew.
        self._damaged: dict[int, list[str]] = {}

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
    def commit(self, step: int, train_state: dict, files: dict[str, dict]) -> CheckpointRef:
        """Record `files` ({name: {size, checksum}}, every rank's reports merged) as checkpoint
        N. Call only after every rank reported its shards written. Reads no file: a listing
        confirms each reported file is there with its reported size (CheckpointError if not)."""
        loc = self.root.child(f"step_{step}")
        if not files:
            raise CheckpointError(f"{loc.uri}: no rank reported a file to commit")
        listed = loc.files()
        found = self._listing_problems(loc.uri, files, listed)
        if found:
            raise CheckpointError(f"{loc.uri}: not as the ranks reported: " + "; ".join(found))
        unreported = sorted(set(listed) - set(files) - {COMMIT_FILE})
        if unreported:  # leftovers of an earlier, failed save of this step: never loaded
            log.warning(
                "%s: %d files no rank reported writing are left out of the manifest: %s",
                loc.uri,
                len(unreported),
                ", ".join(unreported[:5]),
            )
        record = {"step": step, "train_state": train_state, "files": dict(sorted(files.items()))}
        loc.child(COMMIT_FILE).write_json_atomic(record)
        self._damaged.pop(step, None)
        return CheckpointRef(loc.uri, step, True, record)

    # --- damage --------------------------------------------------------------------------------
    def problems(self, ref: CheckpointRef) -> list[str]:
        """What is wrong with a checkpoint as far as metadata tells (commit record, listed
        names and sizes) plus what the ranks found; empty when nothing is known to be wrong.
        Checksums are the ranks' to verify (`digests.verify_files`)."""
        if not ref.committed:
            return [f"{ref.uri}: not committed (no {COMMIT_FILE})"]
        if ref.step in self._damaged:
            return self._damaged[ref.step]
        return self._listing_problems(ref.uri, ref.record["files"], Location.parse(ref.uri).files())

    @staticmethod
    def _listing_problems(uri: str, files: dict[str, dict], listed: dict[str, int]) -> list[str]:
        found = []
        for name, expected in files.items():
            if name not in listed:
                found.append(f"{uri}/{name}: missing")
            elif listed[name] != expected["size"]:
                found.append(f"{uri}/{name}: size {listed[name]} != {expected['size']} recorded")
        return found

    def mark_damaged(self, ref: CheckpointRef, problems: list[str]) -> None:
        """The ranks found `ref` damaged: never offer it again (until step N is committed anew)."""
        self._damaged[ref.step] = list(problems)
        log.warning("checkpoint step %d is damaged: %s", ref.step, "; ".join(problems))

    def latest_valid(self) -> CheckpointRef | None:
        """The newest committed checkpoint not known to be damaged; warns about each newer one
        it skips."""
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


def merge_manifests(per_rank: dict[int, dict[str, dict]]) -> dict[str, dict]:
    """One manifest from every rank's written files ({rank: {name: {size, checksum}}}). A file
    two ranks report must have the same contents in both reports (CheckpointError if not)."""
    merged: dict[str, dict] = {}
    reported_by: dict[str, int] = {}
    for rank, files in sorted(per_rank.items()):
        for name, entry in files.items():
            if name in merged and merged[name] != entry:
                raise CheckpointError(
                    f"{name}: ranks {reported_by[name]} and {rank} report different contents "
                    f"({merged[name]} vs {entry})"
                )
            merged.setdefault(name, entry)
            reported_by.setdefault(name, rank)
    return merged
