"""Initial weights from a Hugging Face-format directory (`ckpt consolidate` output, or a
`save_pretrained` Llama): read its config.json into our model settings, check it against the
configured shape before any actor starts. The ranks read the directory's tensors through
`models.hf_weights.DirectoryWeights`.
"""

from __future__ import annotations

import json
from pathlib import Path

from raytrain_dt.errors import ConfigError
from raytrain_dt.models.hf_weights import INIT_FROM_KEY as KEY
from raytrain_dt.models.presets import ModelShape

# Hugging Face config.json field -> our ModelShape field (the inverse of export.hf_config;
# a unit test keeps the two in step). All but the last two are also `model.*` settings.
SHAPE_FIELDS = {
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "num_key_value_heads": "n_kv_heads",
    "vocab_size": "vocab_size",
    "intermediate_size": "ffn_hidden",
    "tie_word_embeddings": "tie_embeddings",
    "rms_norm_eps": "norm_eps",
    "rope_theta": "rope_theta",
}
_PRESET_ONLY = ("norm_eps", "rope_theta")


def read_hf_config(directory: str | Path) -> dict:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{KEY}: {path} not found (expected a Hugging Face Llama directory)")
    config = json.loads(path.read_text())
    if config.get("model_type") != "llama":
        raise ConfigError(f"{KEY}: {path} has model_type {config.get('model_type')!r}, not llama")
    if config.get("rope_scaling"):
        raise ConfigError(f"{KEY}: {path} uses rope_scaling, which this Llama model does not do")
    return config


def model_overrides(directory: str | Path) -> list[str]:
    """`model.*` dotlist settings that give our model the directory's shape."""
    config = read_hf_config(directory)
    overrides = [
        f"model.{ours}={config[theirs]}"
        for theirs, ours in SHAPE_FIELDS.items()
        if theirs in config and ours not in _PRESET_ONLY
    ]
    return [*overrides, f"{KEY}={directory}"]


def check_matches(directory: str | Path, shape: ModelShape) -> None:
    """ConfigError naming the first field where the directory and the configured model differ."""
    config = read_hf_config(directory)
    for theirs, ours in SHAPE_FIELDS.items():
        value = config.get(theirs, False if theirs == "tie_word_embeddings" else None)
        if value != getattr(shape, ours):
            setting = "model.preset" if ours in _PRESET_ONLY else f"model.{ours}"
            raise ConfigError(
                f"{KEY}: {directory} has {theirs}={value} but the configured model has "
                f"{getattr(shape, ours)} ({setting})"
            )
