"""Typed config schema and the loader that merges recipes and overrides onto it."""

from raytrain_dt.config.load import from_yaml, load_config, to_yaml
from raytrain_dt.config.schema import TrainConfig

__all__ = ["TrainConfig", "from_yaml", "load_config", "to_yaml"]
