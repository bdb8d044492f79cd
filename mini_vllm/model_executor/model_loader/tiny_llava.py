"""A tiny seeded LLaVA checkpoint (CLIP tower + projector + Llama), in Hugging Face's format.

    python -m mini_vllm.model_executor.model_loader.tiny_llava OUT_DIR [--seed N]

writes ``OUT_DIR`` with ``config.json``, ``model.safetensors``, the
tokenizer and the processor (``processor_config.json``,
``preprocessor_config.json``): what transformers' ``LlavaForConditionalGeneration``
and ``AutoProcessor`` load, and what mini_vllm's ``load_model`` reads. No
small vision-language model ships in a package here, so Phase 13's tests,
labs and notebooks build this one (in about a second). mini_vllm-only
tooling, no upstream twin; ``mini_vllm.testing.make_tiny_llava`` is this.

Shapes: 32 x 32 images cut into 8 x 8 patches (16 patches, plus CLIP's class
vector), a 3-layer CLIP tower of width 32 of which LLaVA reads layer -2 (so
mini_vllm builds 2 and skips the last), a projector to the language model's
width 64, and a 3-layer Llama (4 query / 2 KV heads). Each image fills
``TINY_IMAGE_TOKENS`` = 16 placeholder positions. The tokenizer is SmolLM2's
(copied out of its GGUF: needs ``make setup``) plus one added token,
``<image>``; the model's vocabulary is its 49153 ids.

The weights are transformers' own initializer under ``torch.manual_seed(seed)``
with ``initializer_range`` 0.3 for the language model (wide greedy margins,
as model_loader/tiny.py explains) and every LayerNorm / RMSNorm weight drawn
around 1 (so that loading them is tested).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers
from transformers import (
    AutoTokenizer,
    CLIPImageProcessorPil,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
)

TINY_IMAGE_SIZE = 32
TINY_PATCH_SIZE = 8
# Patches per image; the "default" strategy drops the class vector.
TINY_IMAGE_TOKENS = (TINY_IMAGE_SIZE // TINY_PATCH_SIZE) ** 2
IMAGE_TOKEN = "<image>"


def _smollm2_tokenizer():
    from mini_vllm.model_executor.model_loader import smollm2_gguf_path

    gguf_path = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    return tok


def tiny_llava_config(vocab_size: int, image_token_index: int, tok) -> LlavaConfig:
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=TINY_IMAGE_SIZE,
        patch_size=TINY_PATCH_SIZE,
        projection_dim=32,
    )
    text = LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.3,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return LlavaConfig(
        architectures=["LlavaForConditionalGeneration"],
        vision_config=vision,
        text_config=text,
        image_token_index=image_token_index,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        image_seq_length=TINY_IMAGE_TOKENS,
        tie_word_embeddings=False,
    )


def make_tiny_llava(out_dir: str | Path, seed: int = 0) -> Path:
    """Write a tiny seeded LLaVA (weights, tokenizer, processor) into ``out_dir``
    (created); return ``out_dir``."""
    out_dir = Path(out_dir)
    tok = _smollm2_tokenizer()
    image_token_index = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    config = tiny_llava_config(len(tok), image_token_index, tok)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layer_norm" in name or "layrnorm" in name:
                if name.endswith(".weight"):
                    param.copy_(1.0 + 0.2 * torch.randn_like(param))
                else:
                    param.copy_(0.1 * torch.randn_like(param))
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": TINY_IMAGE_SIZE},
        crop_size={"height": TINY_IMAGE_SIZE, "width": TINY_IMAGE_SIZE},
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=TINY_PATCH_SIZE,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's class vector
        image_token=IMAGE_TOKEN,
    )
    processor.save_pretrained(str(out_dir))
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    transformers.utils.logging.disable_progress_bar()
    print(f"wrote {make_tiny_llava(args.out_dir, args.seed)}")


if __name__ == "__main__":
    main()
