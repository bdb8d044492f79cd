"""The HuggingFace transformers reference the engine tests compare against.

A plain greedy loop over transformers' own KV cache, one prompt at a time:
no EOS handling, no padding, nothing that could differ from mini_vllm's
``ignore_eos`` semantics. (tests/test_models.py also checks against
transformers' ``generate`` itself.)
"""

from __future__ import annotations

import torch

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4,",
    "The three primary colors are",
    "Water boils at",
    "A haiku about autumn leaves:\n",
    "In computer science, a linked list is a data structure that",
    "Hi",
]


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """The n tokens transformers picks greedily after ``prompt_ids``."""
    device = next(model.parameters()).device
    out = model(torch.tensor([prompt_ids], device=device), use_cache=True)
    past, tokens = out.past_key_values, []
    for _ in range(n):
        tok = int(out.logits[0, -1].argmax())
        tokens.append(tok)
        out = model(torch.tensor([[tok]], device=device), past_key_values=past, use_cache=True)
        past = out.past_key_values
    return tokens
