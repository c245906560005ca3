"""One doctor check's outcome, and how a list of them is shown (table or JSON)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


@dataclass(frozen=True)
class Check:
    name: str  # e.g. "train_step[fsdp2, emulated]"
    status: str  # PASS, FAIL or SKIP
    detail: str  # one line: what was found, or what went wrong and what to do
    figures: dict = field(default_factory=dict)  # measured numbers (bandwidth, versions, bytes)

    @property
    def failed(self) -> bool:
        return self.status == FAIL


def passed(name: str, detail: str, **figures) -> Check:
    return Check(name, PASS, detail, figures)


def failed(name: str, detail: str, **figures) -> Check:
    return Check(name, FAIL, detail, figures)


def skipped(name: str, detail: str) -> Check:
    return Check(name, SKIP, detail)


def format_table(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = [f"{c.status:4}  {c.name:<{width}}  {c.detail}" for c in checks]
    failures = sum(c.failed for c in checks)
    lines.append(
        f"{len(checks)} checks, {failures} failed"
        if failures
        else f"{len(checks)} checks, all passed or skipped"
    )
    return "\n".join(lines)


def format_json(checks: list[Check]) -> str:
    return json.dumps(
        {"ok": not any(c.failed for c in checks), "checks": [asdict(c) for c in checks]}, indent=2
    )
