"""Bad words: forbid the token that would complete a banned sequence.

Mirrors upstream ``vllm/v1/sample/ops/bad_words.py`` (``apply_bad_words``
:30, ``_apply_bad_words_single_batch`` :9) at v0.22.1.

A bad word is a list of token ids. Its last token is set to -inf on a row
when the row's output so far ends with the word's other tokens; a one-token
bad word is therefore always forbidden. Only the output tokens are matched,
never the prompt, and a word longer than the output plus one is skipped.

Left out (see UPSTREAM_PIN.md): ``apply_bad_words_with_drafts`` (speculative
decoding), and turning bad-word strings into token ids (``SamplingParams``).
"""

from __future__ import annotations

import torch


def apply_bad_words(
    logits: torch.Tensor,
    bad_words_token_ids: dict[int, list[list[int]]],
    past_tokens_ids: list[list[int]],
) -> None:
    """Mask, in place, each row's banned next tokens.

    logits: float32 [B, V]; bad_words_token_ids: row -> its bad words;
    past_tokens_ids: one list of output tokens per row.
    """
    for row, bad_words in bad_words_token_ids.items():
        _apply_bad_words_single_batch(logits[row], bad_words, past_tokens_ids[row])


def _apply_bad_words_single_batch(
    logits: torch.Tensor, bad_words: list[list[int]], past_tokens: list[int]
) -> None:
    """logits: float32 [V], one row (a view, written in place)."""
    for word in bad_words:
        if len(word) > len(past_tokens) + 1:
            continue
        prefix = word[:-1]
        if not prefix or past_tokens[-len(prefix) :] == prefix:
            logits[word[-1]] = float("-inf")
