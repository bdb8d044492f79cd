"""Lab 15.4's prompts and settings (imported by name by its conftest.py and
its suite: this folder is on sys.path because pytest puts the folder of
``conftest.py`` there)."""

from __future__ import annotations

PROMPTS = [
    "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is",
    "A paged KV cache stores keys and values in fixed-size blocks, so that a request "
    "grows one block at a time and",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who "
    "went out every morning and",
]
MAX_TOKENS = 8
BLOCK_SIZE = 16
MODULE = "lab_15_4_your_example_connector"
