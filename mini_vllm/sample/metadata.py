"""Per-batch sampling settings, as tensors the sampler can use at once.

Mirrors upstream ``vllm/v1/sample/metadata.py`` (``SamplingMetadata`` :15) at
v0.22.1. Left out: penalties, bad words, allowed token ids, logit bias,
speculative decoding, per-token logprob requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingMetadata:
    # One row per request that samples this step.
    temperature: torch.Tensor  # float32 [B]; 0 means greedy
    all_greedy: bool
    top_k: torch.Tensor | None  # int64 [B]; 0 = off
    top_p: torch.Tensor | None  # float32 [B]; 1.0 = off
    # A torch.Generator for rows with a seed, None for the others.
    generators: list[torch.Generator | None]
    max_num_logprobs: int | None
    # Rows still short of min_tokens: row -> token ids that may not be sampled yet.
    min_tokens_blocked: dict[int, list[int]]
