"""Where the drafts sit in a verification step's flattened logits.

Mirrors upstream ``vllm/v1/spec_decode/metadata.py`` (``SpecDecodeMetadata``
:10) at v0.22.1. A request with ``d`` drafts is verified with ``d + 1``
logits rows: one per draft (the target's opinion of that draft, "target"
rows) and one after the last draft (the "bonus" row, sampled as usual).

Invariants: ``draft_token_ids`` is flat, request after request;
``cu_num_draft_tokens[i]`` is the number of drafts of requests ``0..i``
(inclusive, no leading zero) and ``cu_num_sampled_tokens`` the same for
``d + 1``; ``max_spec_len`` is the largest ``d`` in the batch. What is left
out: UPSTREAM_PIN.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class SpecDecodeMetadata:
    draft_token_ids: torch.Tensor  # int32 [num_tokens]
    num_draft_tokens: list[int]  # [batch]
    cu_num_draft_tokens: torch.Tensor  # int32 [batch]
    cu_num_sampled_tokens: torch.Tensor  # int32 [batch]
    target_logits_indices: torch.Tensor  # int32 [num_tokens]
    bonus_logits_indices: torch.Tensor  # int32 [batch]
    logits_indices: torch.Tensor  # int32 [num_tokens + batch]
    max_spec_len: int = field(init=False)

    def __post_init__(self):
        self.max_spec_len = max(self.num_draft_tokens)

    @classmethod
    def make_dummy(
        cls, draft_token_ids: list[list[int]], device: torch.device | str = "cpu"
    ) -> SpecDecodeMetadata:
        """Metadata for these drafts with every logits index 0: enough for
        ``rejection_sample``, which reads only the draft fields."""
        batch_size = len(draft_token_ids)
        num_draft_tokens = [len(ids) for ids in draft_token_ids]
        flat = [t for ids in draft_token_ids for t in ids]
        cu_draft = np.cumsum(num_draft_tokens, dtype=np.int32)  # [batch]
        cu_sampled = np.cumsum([n + 1 for n in num_draft_tokens], dtype=np.int32)  # [batch]
        return cls(
            draft_token_ids=torch.tensor(flat, dtype=torch.int32, device=device),
            num_draft_tokens=num_draft_tokens,
            cu_num_draft_tokens=torch.from_numpy(cu_draft).to(device),
            cu_num_sampled_tokens=torch.from_numpy(cu_sampled).to(device),
            target_logits_indices=torch.zeros(len(flat), dtype=torch.int32, device=device),
            bonus_logits_indices=torch.zeros(batch_size, dtype=torch.int32, device=device),
            logits_indices=torch.zeros(len(flat) + batch_size, dtype=torch.int32, device=device),
        )
