"""Tiny seeded Llama, Qwen3 and Ministral checkpoints, in Hugging Face's format.

    python -m mini_vllm.model_executor.model_loader.tiny OUT_DIR
        [--arch llama|qwen3|ministral|all] [--seed N] [--tokenizer]

writes ``OUT_DIR/tiny-llama``, ``OUT_DIR/tiny-qwen3`` and/or
``OUT_DIR/tiny-ministral``, each a folder
with ``config.json``, ``generation_config.json`` and ``model.safetensors``
that ``load_model`` (and transformers) can read. mini_vllm-only tooling, no
upstream twin.

The weights are drawn by transformers' own initializer under
``torch.manual_seed(seed)``, with ``initializer_range`` 0.3 (instead of the
usual 0.02) so that the logits are spread out and greedy choices have wide
margins: token-exact comparisons then do not flip on float rounding. The
norm weights are drawn too (around 1) so that loading them is tested.

Shapes are chosen to exercise the model code: grouped-query attention (4
query heads on 2 KV heads), tied embeddings for Llama and untied for
Qwen3, and for Qwen3 a ``head_dim`` (32) that is not
``hidden_size / num_heads`` (16). Ministral (transformers' Llama with
per-layer ``layer_types``) mixes sliding-window layers (a window of
``TINY_SLIDING_WINDOW`` tokens) with a full-attention one: a hybrid model,
whose KV cache has two groups.

Tokenizer: without ``--tokenizer`` the vocabulary is 512 ids and no
tokenizer is written (feed token ids directly). With it, SmolLM2's
tokenizer is copied out of its GGUF (``save_pretrained``; needs
``make setup``) and the vocabulary is its 49152 ids, so the tiny models
take text, though what they say is noise.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    MinistralConfig,
    PretrainedConfig,
    Qwen3Config,
)

ARCHS = ("llama", "qwen3", "ministral")
# The tiny Ministral's window, in tokens: short, so prompts and outputs pass it.
TINY_SLIDING_WINDOW = 8
SMALL_VOCAB = 512


def tiny_config(arch: str, vocab_size: int = SMALL_VOCAB) -> PretrainedConfig:
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.3,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch == "llama":
        return LlamaConfig(
            architectures=["LlamaForCausalLM"],
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
            **common,
        )
    if arch == "qwen3":
        return Qwen3Config(
            architectures=["Qwen3ForCausalLM"],
            tie_word_embeddings=False,
            head_dim=32,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            **common,
        )
    if arch == "ministral":
        # Full and sliding-window layers mixed (hybrid KV cache: two groups).
        return MinistralConfig(
            architectures=["MinistralForCausalLM"],
            tie_word_embeddings=False,
            head_dim=16,
            sliding_window=TINY_SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **common,
        )
    raise ValueError(f"unknown tiny architecture {arch!r}: use one of {ARCHS}")


def make_tiny_model(
    out_dir: str | Path, arch: str = "qwen3", seed: int = 0, tokenizer: bool = False
) -> Path:
    """Write a tiny seeded checkpoint of ``arch`` into ``out_dir`` (created).

    Returns ``out_dir``."""
    out_dir = Path(out_dir)
    tok = None
    if tokenizer:
        from mini_vllm.model_executor.model_loader import smollm2_gguf_path

        gguf_path = smollm2_gguf_path()
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    config = tiny_config(arch, len(tok) if tok is not None else SMALL_VOCAB)
    if tok is not None:
        config.bos_token_id, config.eos_token_id = tok.bos_token_id, tok.eos_token_id
        config.pad_token_id = tok.pad_token_id

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    if tok is not None:
        tok.save_pretrained(str(out_dir))
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--arch", choices=(*ARCHS, "all"), default="all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tokenizer",
        action="store_true",
        help="copy SmolLM2's tokenizer in (vocabulary 49152 instead of 512)",
    )
    args = parser.parse_args(argv)
    transformers.utils.logging.disable_progress_bar()
    for arch in ARCHS if args.arch == "all" else (args.arch,):
        folder = make_tiny_model(args.out_dir / f"tiny-{arch}", arch, args.seed, args.tokenizer)
        print(f"wrote {folder}")


if __name__ == "__main__":
    main()
