"""raytrain_dt: elastic, topology-aware training of large PyTorch models on Ray clusters.

`from raytrain_dt import Trainer, Result, ModelSpec` is the Python API (`raytrain_dt.api`).
The names load on first use, so importing a submodule (config, topology) stays light.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Trainer": "raytrain_dt.api",
    "Result": "raytrain_dt.api",
    "TrainConfig": "raytrain_dt.config.schema",
    "load_config": "raytrain_dt.config.load",
    "ModelSpec": "raytrain_dt.models.model_spec",
    "ModelParts": "raytrain_dt.models.model_spec",
    "llama_spec": "raytrain_dt.models.model_spec",
    "hf_spec": "raytrain_dt.models.hf",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'raytrain_dt' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
