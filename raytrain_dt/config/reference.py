"""The config reference (docs/config-reference.md), generated from the schema dataclasses.

`python -m raytrain_dt.config.reference > docs/config-reference.md`. Each key's type and default
come from the dataclass field, its description from `metadata={"help": ...}` when given, else
from the comment lines right above the field (or a comment at the end of its line) in
schema.py, and its allowed values and ranges from the checks `validation.py` runs. A unit test
keeps the committed file equal to this output.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys

from raytrain_dt.config import schema, validation

_FIELD_LINE = re.compile(r"^\s+(\w+)\s*:[^=]*?(?:=.*?)?(?:#\s*(?P<inline>.*))?$")
_COMMENT_LINE = re.compile(r"^\s+#\s?(.*)$")


def field_comments(cls: type) -> dict[str, str]:
    """Field name -> the comment block right above it (or its end-of-line comment)."""
    comments: dict[str, str] = {}
    block: list[str] = []
    for line in inspect.getsource(cls).splitlines()[1:]:
        if match := _COMMENT_LINE.match(line):
            block.append(match.group(1).strip())
            continue
        match = _FIELD_LINE.match(line)
        if match and not line.strip().startswith(('"', "'")):
            text = " ".join([*block, match.group("inline") or ""]).strip()
            if text:
                comments[match.group(1)] = text
        block = []
    return comments


def _default(f: dataclasses.Field) -> str:
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return "`[]`" if value == [] else "`{}`" if value == {} else "(see below)"
    value = f.default
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def _type(f: dataclasses.Field) -> str:
    return str(f.type).replace("None", "null").replace("|", "\\|")


def _rules(key: str) -> str:
    if key in validation.CHOICES:
        return (
            "One of "
            + ", ".join(f"`{'null' if v is None else v}`" for v in validation.CHOICES[key])
            + "."
        )
    if key in validation.POSITIVE:
        return "Must be > 0."
    if key in validation.NON_NEGATIVE:
        return "Must be >= 0."
    return ""


_HEADER = ["| key | type | default | description |", "|---|---|---|---|"]


def _rows(cls: type, fields: list[dataclasses.Field], prefix: str) -> list[str]:
    comments = field_comments(cls)
    rows = []
    for f in fields:
        key = f"{prefix}{f.name}"
        help_text = f.metadata.get("help") or comments.get(f.name, "")
        text = " ".join(t for t in (help_text, _rules(key)) if t).replace("|", "\\|")
        rows.append(f"| `{key}` | {_type(f)} | {_default(f)} | {text} |")
    return rows


def _doc(cls: type) -> str:
    doc = inspect.getdoc(cls) or ""
    return "" if doc.startswith(f"{cls.__name__}(") else doc  # dataclass's generated signature


def _nested(f: dataclasses.Field) -> type | None:
    """The dataclass a field holds a section of its own of (`metrics.mlflow`), if any."""
    if f.default_factory is dataclasses.MISSING:
        return None
    value = f.default_factory()
    return type(value) if dataclasses.is_dataclass(value) else None


def _section(cls: type, title: str, prefix: str, intro: str, heading: str) -> list[str]:
    """A section's table, then a section below it for each field that is one of its own."""
    lines = ["", f"{heading} `{title}`", ""]
    intro = " ".join(t for t in (intro, _doc(cls)) if t)
    if intro:
        lines += [intro, ""]
    fields = list(dataclasses.fields(cls))
    lines += [*_HEADER, *_rows(cls, fields, prefix)]
    for f in fields:
        if (sub := _nested(f)) is not None:
            key = f"{prefix}{f.name}"
            lines += _section(sub, key, f"{key}.", "", heading + "#")
    return lines


def render() -> str:
    lines = [
        "# Config reference",
        "",
        "Generated from `raytrain_dt/config/schema.py` by",
        "`python -m raytrain_dt.config.reference > docs/config-reference.md`; do not edit by",
        "hand. Set any key in a recipe (YAML, nested by section) or on the command line as a",
        "dotlist override: `raytrain-dt train conf/tiny.yaml trainer.steps=100 comm.timeout_s=300`.",
        "A wrong key, type or value stops the run before anything starts, naming the key.",
    ]
    top_level = []
    for f in dataclasses.fields(schema.TrainConfig):
        section = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(section):
            cls, prefix = type(section), f"{f.name}."
        elif f.name == "chaos":
            cls, prefix = schema.ChaosAction, "chaos[]."
        else:
            top_level.append(f)
            continue
        intro = field_comments(schema.TrainConfig).get(f.name, "")
        lines += _section(cls, f.name, prefix, intro, "##")
    if top_level:
        lines += ["", "## Top-level keys", "", *_HEADER, *_rows(schema.TrainConfig, top_level, "")]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
