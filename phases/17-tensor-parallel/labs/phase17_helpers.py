"""What Phase 17's graded suites share: the tiny Llama's prompts and budgets."""

from __future__ import annotations

import torch

NUM_TOKENS = 8
KV_BYTES = 4 * 2**20


def prompts() -> list[list[int]]:
    """Two prompts: 28 tokens (two blocks of 16, the decode reaches a third) and 5."""
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in (28, 5)]
