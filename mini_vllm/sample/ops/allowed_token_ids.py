"""allowed_token_ids: every token outside a row's list is set to -inf.

Mirrors upstream ``vllm/v1/worker/gpu_input_batch.py`` at v0.22.1, where
``InputBatch.add_request`` (:335) fills a boolean row per request, and the
one line of ``Sampler.apply_logits_processors``
(vllm/v1/sample/sampler.py:366) that applies it: upstream has no function
of its own for this, so mini_vllm names the two steps.

The mask is True where a token is NOT allowed ("fill with -inf"). Rows of
requests without ``allowed_token_ids`` are all False; the whole mask is
``None`` when no request in the batch has the field. It is the first thing
the sampler applies, before bad words, logits processors and penalties.
"""

from __future__ import annotations

import torch


def allowed_token_ids_mask(
    allowed_token_ids: dict[int, list[int]], num_reqs: int, vocab_size: int
) -> torch.Tensor | None:
    """bool [num_reqs, vocab_size] from row -> allowed ids; None if no row has any."""
    if not allowed_token_ids:
        return None
    mask = torch.zeros((num_reqs, vocab_size), dtype=torch.bool)  # [B, V]
    for row, token_ids in allowed_token_ids.items():
        mask[row] = True
        mask[row, token_ids] = False
    return mask


def apply_allowed_token_ids(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """logits: float32 [B, V], masked in place; mask: bool [B, V] or None."""
    if mask is not None:
        logits.masked_fill_(mask, float("-inf"))
    return logits
