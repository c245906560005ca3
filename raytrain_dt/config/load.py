"""Load a recipe: YAML file + CLI dotlist overrides -> a validated `TrainConfig`.

OmegaConf does the merging and the key and type checks against the dataclass schema; its
exceptions are rewritten into one line that names the key (`trainer.stepz: unknown key`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from raytrain_dt.config.schema import TrainConfig
from raytrain_dt.config.validation import validate
from raytrain_dt.errors import ConfigError


def _one_line(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None) or "config"
    if isinstance(exc, ConfigKeyError):
        return f"{key}: unknown key"
    if isinstance(exc, ValidationError):
        value = getattr(exc, "value", None)
        return f"{key}: {value!r} is not a valid {_declared_type(key)}"
    return f"{key}: {str(exc).splitlines()[0]}"


def _declared_type(dotted_key: str) -> str:
    """The annotation the schema declares for a dotted key such as `trainer.steps`."""
    node: object = TrainConfig()
    annotation = "value"
    for part in dotted_key.split("."):
        fields = (
            {f.name: f for f in dataclasses.fields(node)} if dataclasses.is_dataclass(node) else {}
        )
        if part not in fields:
            break
        annotation = str(fields[part].type)
        node = getattr(node, part)
    return annotation


def load_config(
    recipe: str | Path | None = None, overrides: list[str] | None = None
) -> TrainConfig:
    """Merge the schema defaults, a recipe file and dotlist overrides; validate the result."""
    schema = OmegaConf.structured(TrainConfig)
    layers = [schema]
    if recipe is not None:
        path = Path(recipe)
        if not path.is_file():
            raise ConfigError(f"{path}: recipe file not found")
        try:
            layers.append(OmegaConf.load(path))
        except Exception as exc:  # yaml syntax errors come in several types
            raise ConfigError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from exc
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"{item}: override must look like key=value")
    try:
        if overrides:
            layers.append(OmegaConf.from_dotlist(list(overrides)))
        merged = OmegaConf.merge(*layers)
        OmegaConf.resolve(merged)
        cfg: TrainConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        raise ConfigError(_one_line(exc)) from exc
    return validate(cfg)


def to_yaml(cfg: TrainConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def from_yaml(text: str) -> TrainConfig:
    merged = OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.create(text))
    return validate(OmegaConf.to_object(merged))  # type: ignore[arg-type]
