"""From logits to one token per request: greedy, temperature, top-k, top-p.

Mirrors upstream ``vllm/v1/sample/sampler.py`` (``Sampler`` :20) and
``apply_top_k_top_p`` (ops/topk_topp_sampler.py:311) at v0.22.1. Left out:
penalties, logit bias, bad words, FlashInfer kernels, spec decode.

Order, as upstream: logprobs (if asked) from the *raw* logits; then the
min_tokens rule (stop tokens masked until enough tokens exist); then greedy
rows take the argmax, and random rows divide by temperature, keep the top k,
keep the smallest set of tokens whose probability reaches top_p, and draw.

Drawing uses the "exponential race": argmax(p / E) with E ~ Exp(1) picks a
token with probability p. A seeded request draws its E from its own
generator, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mini_vllm.sample.metadata import SamplingMetadata


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # int64 [B]
    # Per row: (token ids, logprobs, rank of the sampled token), the sampled
    # token first then the top-n; None unless some request asked.
    logprobs: list[tuple[list[int], list[float], int]] | None = None


class Sampler(nn.Module):
    """An ``nn.Module`` as upstream's (vllm/v1/sample/sampler.py:20): call it to sample."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self.apply_min_tokens(logits, metadata)
        sampled = self.sample(logits, metadata)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = self.gather_logprobs(raw_logprobs, metadata.max_num_logprobs, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def apply_min_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        if metadata.min_tokens_blocked:
            logits = logits.clone()  # never write into the caller's tensor
        for row, token_ids in metadata.min_tokens_blocked.items():
            logits[row, token_ids] = float("-inf")
        return logits

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        greedy = logits.argmax(dim=-1)
        if metadata.all_greedy:
            return greedy
        temperature = metadata.temperature.clamp(min=1e-5).unsqueeze(1)
        scaled = logits / temperature
        scaled = apply_top_k_top_p(scaled, metadata.top_k, metadata.top_p)
        probs = torch.softmax(scaled, dim=-1)
        random = self.random_sample(probs, metadata.generators)
        return torch.where(metadata.temperature < 1e-5, greedy, random)

    @staticmethod
    def random_sample(
        probs: torch.Tensor, generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        noise = torch.empty_like(probs)
        for row, gen in enumerate(generators):
            noise[row].exponential_(generator=gen)
        return probs.div(noise).argmax(dim=-1)

    @staticmethod
    def gather_logprobs(logprobs: torch.Tensor, num: int, sampled: torch.Tensor):
        top_vals, top_ids = logprobs.topk(num, dim=-1) if num > 0 else (None, None)
        chosen = logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1)
        # As upstream: the rank counts every token at least as likely, itself included.
        ranks = (logprobs >= chosen.unsqueeze(1)).sum(dim=-1)
        result = []
        for row in range(logprobs.shape[0]):
            ids = [int(sampled[row])]
            vals = [float(chosen[row])]
            if top_ids is not None:
                ids += top_ids[row].tolist()
                vals += top_vals[row].tolist()
            result.append((ids, vals, int(ranks[row])))
        return result


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Set to -inf every logit outside the top k and outside the top-p nucleus.

    top_k 0 and top_p 1.0 switch a row's filter off. The nucleus is the
    smallest set of most likely tokens whose probabilities sum to >= top_p
    (the most likely token always survives).
    """
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
        # Ascending order: the k-th largest sits at index vocab - k.
        threshold = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < threshold, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        cumulative = probs.cumsum(dim=-1)
        # Drop tokens whose cumulative mass (from the least likely up) stays
        # within 1 - top_p; the top token is never dropped.
        drop = cumulative <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
