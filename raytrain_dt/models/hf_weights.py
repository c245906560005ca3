"""Reading a Hugging Face-format directory's tensors slice by slice (`DirectoryWeights`, a
`models.materialize.WeightSource`), and our decoder's parameter names in the Hub's terms
(`hf_name`, the names `ckpt consolidate` writes, so a consolidated checkpoint loads back).

A rank reads only what it holds: safetensors' `get_slice` reads the bytes of one region, and
`pytorch_model*.bin` files are memory-mapped, so only the pages of its slices are touched.
Below the checkpoint package, which exports to and checks these directories.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from raytrain_dt.errors import ConfigError

# The setting whose directory the run starts from; `model.hf` directories pass their own key.
INIT_FROM_KEY = "model.init_from"

# A directory's weights: (one file, the index of a sharded set), in order of preference.
WEIGHT_FILES = (
    ("model.safetensors", "model.safetensors.index.json"),
    ("pytorch_model.bin", "pytorch_model.bin.index.json"),
)

# Our parameter names -> transformers' LlamaForCausalLM names.
_HF_NAMES = [
    (r"^tok_embeddings\.weight$", "model.embed_tokens.weight"),
    (r"^norm\.weight$", "model.norm.weight"),
    (r"^output\.weight$", "lm_head.weight"),
    (r"^layers\.(\d+)\.attention\.wq\.", r"model.layers.\1.self_attn.q_proj."),
    (r"^layers\.(\d+)\.attention\.wk\.", r"model.layers.\1.self_attn.k_proj."),
    (r"^layers\.(\d+)\.attention\.wv\.", r"model.layers.\1.self_attn.v_proj."),
    (r"^layers\.(\d+)\.attention\.wo\.", r"model.layers.\1.self_attn.o_proj."),
    (r"^layers\.(\d+)\.feed_forward\.w1\.", r"model.layers.\1.mlp.gate_proj."),
    (r"^layers\.(\d+)\.feed_forward\.w3\.", r"model.layers.\1.mlp.up_proj."),
    (r"^layers\.(\d+)\.feed_forward\.w2\.", r"model.layers.\1.mlp.down_proj."),
    (r"^layers\.(\d+)\.attention_norm\.", r"model.layers.\1.input_layernorm."),
    (r"^layers\.(\d+)\.ffn_norm\.", r"model.layers.\1.post_attention_layernorm."),
]


def hf_name(name: str) -> str:
    for pattern, replacement in _HF_NAMES:
        if re.match(pattern, name):
            return re.sub(pattern, replacement, name)
    raise KeyError(f"{name}: no Hugging Face Llama name for this parameter")


def tensor_files(directory: Path, key: str = INIT_FROM_KEY) -> dict[str, Path]:
    """Tensor name -> the file holding it: safetensors (one file or an index), else
    `pytorch_model*.bin` files."""
    for single, index in WEIGHT_FILES:
        if (directory / index).is_file():
            weight_map = json.loads((directory / index).read_text())["weight_map"]
            return {name: directory / file for name, file in weight_map.items()}
        if (directory / single).is_file():
            return dict.fromkeys(_open(directory / single).keys(), directory / single)
    raise ConfigError(f"{key}: {directory} has no model.safetensors, pytorch_model.bin or index")


def _open(path: Path):
    """A reader of one file: safe_open, or a memory-mapped torch file (a dict of tensors)."""
    if path.suffix == ".safetensors":
        return safe_open(path, "pt")
    return torch.load(path, map_location="cpu", mmap=True, weights_only=True)


class DirectoryWeights:
    """The region of each tensor that a rank's shard covers, read from the directory's files.
    `rename` maps a parameter name to the file's tensor name (our names to the Hub's)."""

    def __init__(self, directory: str | Path, key: str = INIT_FROM_KEY, rename=None):
        self.directory = Path(directory)
        self.key = key
        self.rename = rename or (lambda name: name)
        self.files = tensor_files(self.directory, key)
        self._readers: dict[Path, object] = {}

    def read(self, name: str, module, shape: tuple[int, ...], index: tuple[slice, ...]):
        stored = self.rename(name)
        if stored not in self.files:
            raise ConfigError(f"{self.key}: {self.directory} has no tensor {stored}")
        path = self.files[stored]
        if path not in self._readers:
            self._readers[path] = _open(path)
        reader = self._readers[path]
        if path.suffix == ".safetensors":
            tensor = reader.get_slice(stored)
            found = tuple(tensor.get_shape())
        else:
            tensor = reader[stored]
            found = tuple(tensor.shape)
        if found != tuple(shape):
            raise ConfigError(f"{self.key}: {stored} has shape {found}, the model {tuple(shape)}")
        return tensor[index].to(torch.float32)
