"""The HuggingFace transformers reference the engine tests compare against:
the prompts, and ``hf_greedy`` (mini_vllm/testing.py, shared with the
graded labs): a plain greedy loop over transformers' own KV cache, one
prompt at a time. (tests/test_models.py also checks against transformers'
``generate`` itself.)
"""

from __future__ import annotations

from mini_vllm.testing import hf_greedy  # noqa: F401 (the loop lives there)

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
