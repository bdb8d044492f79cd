"""Repetition, frequency and presence penalties on a batch of logits.

Mirrors upstream ``vllm/v1/sample/ops/penalties.py`` (``apply_all_penalties``
:11, ``_convert_to_tensors`` :42) at v0.22.1, together with the helpers it
calls elsewhere: ``get_token_bin_counts_and_mask``
(vllm/model_executor/layers/utils.py:34), ``apply_penalties``
(vllm/model_executor/layers/utils.py:51) and the torch form of the
repetition penalty, ``apply_repetition_penalties_torch``
(vllm/_custom_ops.py:360).

What each penalty reads, as upstream:
- repetition (a factor, 1.0 = off) applies to every token seen in the prompt
  OR the output: a positive logit is multiplied by ``1 / penalty``, any other
  logit by ``penalty``;
- frequency (OpenAI's definition) subtracts ``penalty * count`` where count
  is how often the token appears in the output only;
- presence subtracts ``penalty`` once for every token present in the output
  only.
They apply in that order, in place. Token lists are padded to a rectangle
with ``vocab_size``, an id no token has; its counts land in an extra bin that
is dropped. A ``-1`` in the output lists (upstream's placeholder for a token
not sampled yet under async scheduling) is treated as padding too.

Left out (see UPSTREAM_PIN.md): the CUDA kernel upstream uses for the
repetition penalty on contiguous GPU logits, and pinned host memory.
"""

from __future__ import annotations

import torch


def apply_all_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor,
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
    output_token_ids: list[list[int]],
) -> torch.Tensor:
    """Apply the three penalties in place and return ``logits``.

    ``prompt_token_ids`` is already padded with ``vocab_size`` (the persistent
    batch builds it); ``output_token_ids`` holds one list per row.
    """
    _, vocab_size = logits.shape
    output_tokens = _convert_to_tensors(output_token_ids, vocab_size, logits.device)
    output_tokens.masked_fill_(output_tokens == -1, vocab_size)  # int64 [B, max_out]
    return apply_penalties(
        logits,
        prompt_token_ids,
        output_tokens,
        presence_penalties,
        frequency_penalties,
        repetition_penalties,
    )


def _convert_to_tensors(
    token_ids: list[list[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """One row per list, padded on the right with ``vocab_size``."""
    width = max((len(row) for row in token_ids), default=0)
    padded = torch.full((len(token_ids), width), vocab_size, dtype=torch.int64)  # [B, width]
    for row, ids in enumerate(token_ids):
        padded[row, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    return padded.to(device)


def get_token_bin_counts_and_mask(
    tokens: torch.Tensor, vocab_size: int, num_seqs: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, how many times each token id occurs, and whether it occurs.

    ``tokens`` is int64 [num_seqs, L] padded with ``vocab_size``.
    """
    # One extra bin catches the padding id.
    counts = torch.zeros((num_seqs, vocab_size + 1), dtype=torch.long, device=tokens.device)
    counts.scatter_add_(1, tokens, torch.ones_like(tokens))  # int64 [B, V + 1]
    counts = counts[:, :vocab_size]  # int64 [B, V]
    return counts, counts > 0


def apply_penalties(
    logits: torch.Tensor,
    prompt_tokens_tensor: torch.Tensor,
    output_tokens_tensor: torch.Tensor,
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
) -> torch.Tensor:
    """Apply repetition, then frequency, then presence penalties in place.

    logits: float32 [B, V]; the two token tensors: int64 [B, L] padded with V;
    the three penalties: float32 [B].
    """
    num_seqs, vocab_size = logits.shape
    # BEGIN LAB 06.1: what each penalty reads: repetition prompt + output, the others output only
    # HINT: receives logits float32 [B, V] and the two padded token tensors; leaves logits
    # HINT: penalised in place, in upstream's order: repetition, then frequency, then presence.
    # HINT: get_token_bin_counts_and_mask(tokens, vocab_size, num_seqs) gives (counts, mask),
    # HINT: int64 and bool [B, V], the padding id vocab_size already dropped.
    # HINT: apply_repetition_penalties takes the prompt's mask AND the output's mask; frequency
    # HINT: subtracts penalty * (how often in the output); presence subtracts penalty once per
    # HINT: token present in the output. Neither of the last two looks at the prompt.
    _, prompt_mask = get_token_bin_counts_and_mask(prompt_tokens_tensor, vocab_size, num_seqs)
    output_counts, output_mask = get_token_bin_counts_and_mask(
        output_tokens_tensor, vocab_size, num_seqs
    )
    apply_repetition_penalties(logits, prompt_mask, output_mask, repetition_penalties)
    logits -= frequency_penalties.unsqueeze(1) * output_counts  # float32 [B, V]
    logits -= presence_penalties.unsqueeze(1) * output_mask  # float32 [B, V]
    # END LAB 06.1
    return logits


# BEGIN LAB 06.1: the repetition penalty: shrink what was seen, whatever its sign
def apply_repetition_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_mask: torch.Tensor,
    repetition_penalties: torch.Tensor,
) -> None:
    """Scale, in place, the logits of tokens seen in the prompt or the output.

    Upstream multiplies by the reciprocal rather than dividing; so does this,
    which keeps the results bit-identical.
    """
    # HINT: A token seen in the prompt OR the output gets its row's penalty p (float32 [B]);
    # HINT: an unseen token is left alone (factor 1).
    # HINT: A positive logit is multiplied by 1 / p (not divided by p: the float32 rounding
    # HINT: differs and the grade is bit for bit), a zero or negative one by p, so with
    # HINT: p > 1 a seen token always becomes less likely. Write into logits in place.
    seen = prompt_mask | output_mask  # bool [B, V]
    penalty = torch.where(seen, repetition_penalties.unsqueeze(1), 1.0)  # float32 [B, V]
    logits *= torch.where(logits > 0, 1.0 / penalty, penalty)  # float32 [B, V]


# END LAB 06.1
