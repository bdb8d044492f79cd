"""Per-batch sampling settings, as tensors the sampler can use at once.

Mirrors upstream ``vllm/v1/sample/metadata.py`` (``SamplingMetadata`` :15) at
v0.22.1, field for field for what mini_vllm supports. Differences (see
UPSTREAM_PIN.md): ``temperature`` is always a tensor (upstream: None when
every row is greedy); ``min_tokens_blocked`` is mini's, because min_tokens
is state of the persistent batch (Lab 05.1) instead of a logits processor.
Left out: ``logprob_token_ids``, ``spec_token_ids`` and the thinking budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mini_vllm.sample.logits_processor import LogitsProcessors


@dataclass
class SamplingMetadata:
    # One row per request that samples this step.
    temperature: torch.Tensor  # float32 [B]; 0 means greedy
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None  # float32 [B]; 1.0 = off; None: no row uses it
    top_k: torch.Tensor | None  # int [B]; vocab_size = off; None: no row uses it
    # Row -> generator, only for rows whose request has a seed.
    generators: dict[int, torch.Generator]
    max_num_logprobs: int | None

    no_penalties: bool
    prompt_token_ids: torch.Tensor | None  # int64 [B, max prompt], padded with vocab_size
    frequency_penalties: torch.Tensor  # float32 [B]; 0 = off
    presence_penalties: torch.Tensor  # float32 [B]; 0 = off
    repetition_penalties: torch.Tensor  # float32 [B]; 1 = off
    # Each row's live output token list ([] when no feature reads them).
    output_token_ids: list[list[int]]
    allowed_token_ids_mask: torch.Tensor | None  # bool [B, V]; True = not allowed
    bad_words_token_ids: dict[int, list[list[int]]]  # row -> its bad words
    logitsprocs: LogitsProcessors
    # Rows still short of min_tokens: row -> token ids that may not be sampled yet.
    min_tokens_blocked: dict[int, list[int]]
