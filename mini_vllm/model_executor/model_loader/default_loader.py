"""Loading a Hugging Face checkpoint folder: config.json plus *.safetensors.

Mirrors upstream ``vllm/model_executor/model_loader/default_loader.py`` at
v0.22.1 (``DefaultModelLoader`` at :43, which lists the files in
``DefaultModelLoader._prepare_weights`` at :97) and the iterator
``safetensors_weights_iterator`` (weight_utils.py:893). Left out: hub
downloads, ``.bin``/``.pt`` checkpoints, prefetching, multi-threaded and
alternative safetensors readers, expert-parallel filtering.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def find_safetensors(folder: Path) -> list[Path]:
    """The folder's weight files, in name order; FileNotFoundError if there are none."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        hint = f" (found {others}: only safetensors are supported)" if others else ""
        raise FileNotFoundError(
            f"{folder}: no *.safetensors weight files next to config.json{hint}"
        )
    return files


def load_hf_config(folder: Path) -> PretrainedConfig:
    """config.json, parsed by transformers (no network: the path is local)."""
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: no config.json in this folder")
    return AutoConfig.from_pretrained(str(folder))


def safetensors_weights_iterator(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every file, one tensor in memory at a time."""
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES)
