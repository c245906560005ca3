"""docs/config-reference.md is the generator's output for the current schema, and the
generator really reads what the schema says (every key, its default, its comment)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from raytrain_dt.config import schema
from raytrain_dt.config.reference import field_comments, render

COMMITTED = Path(__file__).resolve().parents[2] / "docs" / "config-reference.md"


def test_committed_reference_is_up_to_date_with_the_schema():
    assert COMMITTED.read_text() == render(), (
        "docs/config-reference.md is stale: run "
        "`python -m raytrain_dt.config.reference > docs/config-reference.md`"
    )


def _sections(cls: type, prefix: str = ""):
    """(dotted prefix, dataclass) of every section and section within one (`metrics.mlflow`)."""
    for f in dataclasses.fields(cls):
        value = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(value):
            yield f"{prefix}{f.name}", value
            yield from _sections(type(value), f"{prefix}{f.name}.")


def test_every_schema_key_is_documented_with_its_default():
    text = render()
    sections = list(_sections(schema.TrainConfig))
    assert ("metrics.mlflow", schema.MlflowConfig()) in sections
    for name, value in sections:
        for f in dataclasses.fields(value):
            row = next(
                line for line in text.splitlines() if line.startswith(f"| `{name}.{f.name}` |")
            )
            if f.default is None:
                assert "| `null` |" in row
            elif isinstance(f.default, bool):
                assert f"| `{str(f.default).lower()}` |" in row
            elif f.default is not dataclasses.MISSING:
                assert f"| `{f.default}` |" in row


def test_comments_above_and_beside_a_field_become_its_help():
    @dataclasses.dataclass
    class Example:
        # First line
        # second line.
        a: int = 1
        b: str = "x"  # beside b

        c: float = 0.0

    assert field_comments(Example) == {"a": "First line second line.", "b": "beside b"}
    assert "Collective timeout" in field_comments(schema.CommConfig)["timeout_s"]
