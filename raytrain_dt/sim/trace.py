"""Cluster event traces for the simulator: synthetic (seeded), read from a file, or from a chaos list.

A time trace is three parallel arrays sorted by time: `t` (seconds since the run started),
`kind` (NOTICE, DOWN, UP) and `node` (an integer slot id). Nodes 0..nodes-1 are up at t=0.
- NOTICE: a preemption notice; the node goes DOWN `notice_s` later (it must still be up).
- DOWN: the node is gone (preempted, failed, or lost with its zone).
- UP: the node is back (a spot replacement, or a new node: any id not seen before).

File formats (`load_trace`):
- JSON: {"nodes": 1024, "duration_s": 604800,
         "events": [{"t": 12.5, "kind": "notice", "node": 17}, ...]}
  (`nodes` and `duration_s` are optional; the CLI's --nodes and --days fill them in).
- CSV: a header `t,kind,node`, then one event per line (kind: notice, down or up).

A step trace (`StepTrace`) is the coordinator's chaos list: node actions fire when the run
reaches a step, so the simulator can replay exactly what a real embedded run did.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from raytrain_dt.config.schema import ChaosAction
from raytrain_dt.errors import UserError

NOTICE, DOWN, UP = 0, 1, 2
KIND_NAMES = ("notice", "down", "up")
HOUR = 3600.0
DAY = 24 * HOUR


@dataclass(frozen=True)
class TraceSpec:
    """How a synthetic trace is drawn. Rates are per node (or per zone) and hour/day."""

    nodes: int = 1024
    duration_s: float = 7 * DAY
    # Spot preemptions (about one per node-month) and hardware failures (never noticed; about
    # Llama 3's 419 unexpected interruptions in 54 days on 16k GPUs), each a Poisson process
    # per node while it is up.
    preemptions_per_node_day: float = 0.033
    failures_per_node_day: float = 0.004
    # Fraction of preemptions that come with a notice, and how long before the node goes.
    notice_fraction: float = 1.0
    notice_s: float = 120.0
    # A preempted node's replacement arrives after an exponential delay with this mean.
    replacement_mean_s: float = 1800.0
    # Correlated outages: a zone of `zone_size` consecutive nodes goes down together (no
    # notice) and comes back after an exponential time with mean `zone_outage_mean_s`.
    zone_size: int = 64
    zone_outages_per_day: float = 0.2
    zone_outage_mean_s: float = 3600.0
    seed: int = 0


@dataclass
class Trace:
    nodes: int
    duration_s: float
    t: np.ndarray
    kind: np.ndarray
    node: np.ndarray
    source: str = "synthetic"

    def __len__(self) -> int:
        return len(self.t)

    def counts(self) -> dict[str, int]:
        return {name: int((self.kind == k).sum()) for k, name in enumerate(KIND_NAMES)}

    def to_json(self) -> dict:
        events = [
            {"t": round(float(t), 3), "kind": KIND_NAMES[k], "node": int(n)}
            for t, k, n in zip(self.t, self.kind, self.node, strict=True)
        ]
        return {"nodes": self.nodes, "duration_s": self.duration_s, "events": events}


def _sorted_trace(nodes, duration_s, t, kind, node, source) -> Trace:
    t, kind, node = np.asarray(t, float), np.asarray(kind, np.int8), np.asarray(node, np.int64)
    keep = t < duration_s
    order = np.lexsort((node[keep], kind[keep], t[keep]))
    return Trace(
        nodes, float(duration_s), t[keep][order], kind[keep][order], node[keep][order], source
    )


def _merge(intervals: list[tuple[float, float, bool]]) -> list[tuple[float, float, bool]]:
    """Union of (start, end, noticed) down intervals; a merged one keeps its first start's notice."""
    merged: list[list] = []
    for start, end, noticed in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end, noticed])
    return [tuple(m) for m in merged]


def synthetic_trace(spec: TraceSpec) -> Trace:
    """Draw a trace: per-node up/down alternation (vectorized) plus zone outages, merged."""
    rng = np.random.default_rng(spec.seed)
    n, horizon = spec.nodes, spec.duration_s
    rate = (spec.preemptions_per_node_day + spec.failures_per_node_day) / DAY
    noticed_share = spec.notice_fraction * spec.preemptions_per_node_day / DAY / rate if rate else 0
    # Enough up/down cycles per node to pass the horizon with overwhelming probability.
    cycles = int(horizon * rate * 3 + 8) if rate > 0 else 0
    per_node: list[list[tuple[float, float, bool]]] = [[] for _ in range(n)]
    if cycles:
        up = rng.exponential(1 / rate, size=(n, cycles))
        down = rng.exponential(spec.replacement_mean_s, size=(n, cycles))
        noticed = rng.random(size=(n, cycles)) < noticed_share
        starts = np.cumsum(up, axis=1) + np.concatenate(
            [np.zeros((n, 1)), np.cumsum(down, axis=1)[:, :-1]], axis=1
        )
        ends = starts + down
        for i, j in zip(*np.nonzero(starts < horizon), strict=True):
            per_node[i].append((float(starts[i, j]), float(ends[i, j]), bool(noticed[i, j])))
    zones = max(1, -(-n // spec.zone_size))
    outages = rng.poisson(spec.zone_outages_per_day * horizon / DAY)
    for start, zone, length in zip(
        rng.uniform(0, horizon, outages),
        rng.integers(0, zones, outages),
        rng.exponential(spec.zone_outage_mean_s, outages),
        strict=True,
    ):
        for i in range(zone * spec.zone_size, min(n, (zone + 1) * spec.zone_size)):
            per_node[i].append((float(start), float(start + length), False))
    t, kind, node = [], [], []
    for i, intervals in enumerate(per_node):
        previous_up = 0.0
        for start, end, noticed in _merge(intervals):
            if noticed and spec.notice_s > 0:
                t.append(max(previous_up, start - spec.notice_s))
                kind.append(NOTICE)
                node.append(i)
            t += [start, end]
            kind += [DOWN, UP]
            node += [i, i]
            previous_up = end
    return _sorted_trace(n, horizon, t, kind, node, f"synthetic seed={spec.seed}")


def load_trace(path: str | Path, nodes: int, duration_s: float) -> Trace:
    """Read a JSON or CSV trace (schema in the module docstring); bad input names the line."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"--trace: {path} does not exist")
    if path.suffix == ".json":
        record = json.loads(path.read_text())
        nodes = int(record.get("nodes", nodes))
        duration_s = float(record.get("duration_s", duration_s))
        rows = record.get("events", [])
    else:
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
    t, kind, node = [], [], []
    for i, row in enumerate(rows):
        try:
            t.append(float(row["t"]))
            kind.append(KIND_NAMES.index(str(row["kind"]).strip()))
            node.append(int(row["node"]))
        except (KeyError, ValueError) as exc:
            raise UserError(
                f"--trace: {path} event {i}: {row!r} is not "
                f"{{t, kind (notice|down|up), node}} ({exc})"
            ) from None
    return _sorted_trace(nodes, duration_s, t, kind, node, str(path))


@dataclass
class StepTrace:
    """Node actions of a chaos list (kill_node, preempt_node, add_node), fired by step."""

    nodes: int
    actions: list[ChaosAction] = field(default_factory=list)
    source: str = "chaos"

    @classmethod
    def from_chaos(cls, nodes: int, chaos: list[ChaosAction]) -> StepTrace:
        node_actions = ("kill_node", "preempt_node", "add_node")
        return cls(nodes, [a for a in chaos if a.action in node_actions])
