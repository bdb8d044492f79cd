"""Top-k and top-p masks, then one random draw per row.

Mirrors upstream ``vllm/v1/sample/ops/topk_topp_sampler.py`` at v0.22.1:
``TopKTopPSampler`` :22 with its ``forward_native`` :111,
``apply_top_k_top_p`` :311 (which on a CPU runs ``apply_top_k_top_p_pytorch``
:328, and ``apply_top_k_only`` :372 when there is no top-p) and
``random_sample`` :395.

The masks, as upstream (the logits tensor is updated in place):
- ``k`` and ``p`` are per-row tensors; ``k == vocab_size`` and ``p == 1.0``
  switch a row's filter off (the persistent batch stores those for "off").
  ``None`` means no row uses the filter.
- top-k keeps every logit >= the k-th largest, so a tie at the boundary
  keeps all tied tokens (a row may keep more than k).
- top-p sorts ascending, takes the softmax of what top-k left, and drops
  each token whose cumulative probability (counted from the least likely
  up) is <= 1 - p. What survives is the smallest set of most likely tokens
  whose mass reaches p; the most likely token always survives. Tied tokens
  at that boundary are split by the sort's order, not kept together.

The draw is the "exponential race": with q ~ Exp(1) per token,
argmax(probs / q) picks each token with its probability. Rows with a
``torch.Generator`` (requests with a seed) draw their q from it; the other
rows draw from torch's global generator, all at once, before the seeded rows
overwrite theirs. So a seeded row's token does not depend on its batch.

Left out (see UPSTREAM_PIN.md): the FlashInfer, ROCm aiter, XPU and CPU
platform paths (``forward_cpu`` :159 ignores the generators unless every row
has one), the Triton top-k/top-p kernel.
"""

from __future__ import annotations

import torch


class TopKTopPSampler:
    """Top-k / top-p masking followed by a random draw, upstream's native path.

    Calling it runs ``forward_native``. ``logprobs_mode`` decides what it
    returns beside the int64 [B] tokens: the masked logits for
    ``"processed_logits"``, their log-softmax for ``"processed_logprobs"``,
    otherwise ``None``.
    """

    def __init__(self, logprobs_mode: str = "raw_logprobs") -> None:
        self.logprobs_mode = logprobs_mode

    def forward_native(
        self,
        logits: torch.Tensor,
        generators: dict[int, torch.Generator],
        k: torch.Tensor | None,
        p: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = apply_top_k_top_p(logits, k, p)  # float32 [B, V]
        processed = None
        if self.logprobs_mode == "processed_logits":
            processed = logits
        elif self.logprobs_mode == "processed_logprobs":
            processed = logits.log_softmax(dim=-1, dtype=torch.float32)  # float32 [B, V]
        probs = logits.softmax(dim=-1, dtype=torch.float32)  # float32 [B, V]
        return random_sample(probs, generators), processed

    __call__ = forward_native


def apply_top_k_top_p(
    logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None
) -> torch.Tensor:
    """Set to -inf every logit outside the top k and outside the top-p nucleus.

    logits: float32 [B, V], masked in place; k: int [B] in 1..V; p: float32 [B].
    """
    if p is None:
        if k is None:
            return logits
        return apply_top_k_only(logits, k)  # no need to sort the whole vocabulary
    # BEGIN LAB 06.2: top-k then top-p on the ascending sort
    # HINT: receives logits float32 [B, V], k int [B] or None, p float32 [B]; leaves
    # HINT: sorted_logits and order, the ascending sort of logits and its indices, with every
    # HINT: value outside the top k and outside the top-p nucleus set to -inf.
    # HINT: Sort ascending (upstream does; the order of tied tokens depends on it). Top-k: the
    # HINT: k-th largest sits at position V - k; drop everything strictly below it (ties stay).
    # HINT: Top-p: the softmax of what top-k left, its cumulative sum from the least likely up;
    # HINT: drop each token whose cumulative probability is <= 1 - p, but never the last
    # HINT: (most likely) one. "off" rows hold k = V and p = 1.0 and must lose nothing.
    sorted_logits, order = logits.sort(dim=-1, descending=False)  # [B, V] each
    if k is not None:
        # Ascending order: the k-th largest sits at position V - k.
        kth = sorted_logits.gather(1, (sorted_logits.shape[1] - k.long()).unsqueeze(1))  # [B, 1]
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)  # float32 [B, V]
    cumulative = probs.cumsum(dim=-1)  # float32 [B, V], ends at 1
    drop = cumulative <= 1 - p.unsqueeze(1)  # bool [B, V]
    drop[:, -1] = False  # the most likely token always stays
    sorted_logits.masked_fill_(drop, float("-inf"))
    # END LAB 06.2
    return logits.scatter_(dim=-1, index=order, src=sorted_logits)


# BEGIN LAB 06.2: top-k without sorting the vocabulary
def apply_top_k_only(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Top-k without a full sort: compare each row to its k-th largest logit.

    logits: float32 [B, V], masked in place; k: int [B], V meaning "off".
    """
    # HINT: One logits.topk call for the whole batch, of the largest k any row needs, gives
    # HINT: each row's k-th largest value (at index k - 1 of its row). Every logit strictly
    # HINT: below its row's k-th largest becomes -inf (a tie at the boundary keeps all tied
    # HINT: tokens); return logits, masked in place.
    # HINT: A row with k == V is "off": it must keep everything, and must not make topk
    # HINT: sort the whole vocabulary when no other row needs it.
    off = k == logits.shape[1]  # bool [B]
    k = k.masked_fill(off, 1)  # [B]; an "off" row reads its largest, then ignores it
    top = logits.topk(int(k.max()), dim=1).values  # float32 [B, max k]
    kth = top.gather(1, (k - 1).long().unsqueeze(1))  # float32 [B, 1]
    kth.masked_fill_(off.unsqueeze(1), float("-inf"))
    return logits.masked_fill_(logits < kth, float("-inf"))


# END LAB 06.2


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One token per row by the exponential race; ``probs`` is overwritten.

    probs: float32 [B, V]; generators: row -> generator for the seeded rows.
    Returns int64 [B].
    """
    q = torch.empty_like(probs)  # float32 [B, V]
    if len(generators) != probs.shape[0]:
        q.exponential_()  # every row from the global generator, in one call
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    return probs.div_(q).argmax(dim=-1).view(-1)
