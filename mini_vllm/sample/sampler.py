"""From logits to one token per request, in upstream's order.

Mirrors upstream ``vllm/v1/sample/sampler.py`` (``Sampler`` :20,
``Sampler.forward`` :67, ``Sampler.sample`` :238,
``Sampler.apply_logits_processors`` :366) at v0.22.1, with the pieces in
``mini_vllm/sample/ops/`` and ``mini_vllm/sample/logits_processor/``.

The order, as upstream:
1. logprobs (if some row asked) of the *raw* logits, in the two raw modes
   of ``logprobs_mode`` (upstream's literal type at vllm/config/model.py:98-100):
   ``raw_logprobs`` (upstream's default) their log-softmax, ``raw_logits``
   a float32 copy of the logits themselves;
2. ``apply_logits_processors``: allowed_token_ids, bad words, then the
   processors that can change a greedy pick (min_tokens, logit_bias, then
   custom ones), then the repetition / frequency / presence penalties;
3. ``sample``: greedy rows take the argmax of those logits; if some row
   samples at random, every row is divided by its temperature (greedy rows
   by 1), the argmax-invariant processors run (min_p), then top-k / top-p
   and the exponential-race draw (a seeded row draws from its own
   generator, so its tokens do not depend on the rest of the batch);
4. in the two processed modes the logprobs are those of the logits the
   draw used instead: ``processed_logits`` the logits after top-k / top-p
   (after penalties only, when every row is greedy), ``processed_logprobs``
   their log-softmax. Then the sampled token's value, its rank and the
   top-n are gathered from whichever tensor the mode chose.

Differences (see UPSTREAM_PIN.md): the logits are copied to float32 first,
so the caller's tensor is never written (upstream processes its float32
logits in place); min_tokens is applied from the batch's
``min_tokens_blocked`` at the place upstream's ``MinTokensLogitsProcessor``
runs (first of the non-argmax-invariant processors); on a CPU the greedy
argmax goes through chunk maxima (``greedy_sample``), the same index. Left out:
``logprobs_mode_override``, ``logprob_token_ids``, spec-decode bonus
tokens, the thinking budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from mini_vllm.config import verify_logprobs_mode
from mini_vllm.sample.metadata import SamplingMetadata
from mini_vllm.sample.ops.allowed_token_ids import apply_allowed_token_ids
from mini_vllm.sample.ops.bad_words import apply_bad_words
from mini_vllm.sample.ops.penalties import apply_all_penalties
from mini_vllm.sample.ops.topk_topp_sampler import TopKTopPSampler

_SAMPLING_EPS = 1e-5
# greedy_sample's chunk of logits on a CPU (its largest; a divisor of the vocabulary).
ARGMAX_CHUNK = 1024


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # int64 [B]
    # Per row: (token ids, logprobs, rank of the sampled token), the sampled
    # token first then the top-n; None unless some request asked. From the
    # rejection sampler: per row a list of such entries, one per position.
    logprobs: list[tuple[list[int], list[float], int]] | None = None


class Sampler(nn.Module):
    """An ``nn.Module`` as upstream's (vllm/v1/sample/sampler.py:20): call it to sample."""

    def __init__(self, logprobs_mode: str = "raw_logprobs") -> None:
        super().__init__()
        verify_logprobs_mode(logprobs_mode)
        self.logprobs_mode = logprobs_mode
        self.topk_topp_sampler = TopKTopPSampler(logprobs_mode)

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        wants_logprobs = metadata.max_num_logprobs is not None
        raw_logprobs = None
        if wants_logprobs and self.logprobs_mode == "raw_logprobs":
            raw_logprobs = torch.log_softmax(logits.float(), dim=-1)  # float32 [B, V]
        elif wants_logprobs and self.logprobs_mode == "raw_logits":
            raw_logprobs = logits.to(torch.float32, copy=True)  # float32 [B, V]
        # A copy: every step below writes in place.
        logits = logits.to(torch.float32, copy=True)  # float32 [B, V]
        logits = self.apply_logits_processors(logits, metadata)
        sampled, processed_logprobs = self.sample(logits, metadata)  # int64 [B], [B, V] or None
        if processed_logprobs is not None:
            raw_logprobs = processed_logprobs
        logprobs = None
        if wants_logprobs:
            logprobs = self.gather_logprobs(raw_logprobs, metadata.max_num_logprobs, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def apply_logits_processors(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Everything that applies to greedy and random rows alike, in place."""
        # BEGIN LAB 06.4: the processors every row gets, in upstream's order
        # HINT: receives logits float32 [B, V] and metadata; leaves logits with, in this order:
        # HINT: allowed_token_ids (apply_allowed_token_ids with metadata.allowed_token_ids_mask),
        # HINT: bad words (apply_bad_words, only if some row has any; it reads the output
        # HINT: tokens), min_tokens (every id in metadata.min_tokens_blocked[row] to -inf: it is
        # HINT: where upstream's MinTokensLogitsProcessor runs, the first of the
        # HINT: non-argmax-invariant processors), the other non-argmax-invariant processors
        # HINT: (logit_bias, custom ones: processor.apply returns the logits), and last the
        # HINT: penalties (apply_all_penalties, only when not metadata.no_penalties).
        # HINT: The order matters: a repetition penalty scales a bias, a bias may lift a
        # HINT: token the allowed list dropped to -inf only to nowhere (-inf + bias is -inf).
        apply_allowed_token_ids(logits, metadata.allowed_token_ids_mask)
        if metadata.bad_words_token_ids:
            apply_bad_words(logits, metadata.bad_words_token_ids, metadata.output_token_ids)
        for row, token_ids in metadata.min_tokens_blocked.items():
            logits[row, token_ids] = float("-inf")
        for processor in metadata.logitsprocs.non_argmax_invariant:
            logits = processor.apply(logits)
        if not metadata.no_penalties:
            logits = apply_all_penalties(
                logits,
                metadata.prompt_token_ids,
                metadata.presence_penalties,
                metadata.frequency_penalties,
                metadata.repetition_penalties,
                metadata.output_token_ids,
            )
        # END LAB 06.4
        return logits

    def sample(
        self, logits: torch.Tensor, metadata: SamplingMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens int64 [B], and the processed logits or logprobs float32 [B, V]
        in the processed modes (None in the raw ones)."""
        greedy = None if metadata.all_random else self.greedy_sample(logits)  # int64 [B]
        if metadata.all_greedy:
            processed = None
            if metadata.max_num_logprobs is not None:
                if self.logprobs_mode == "processed_logits":
                    processed = logits
                elif self.logprobs_mode == "processed_logprobs":
                    processed = logits.log_softmax(dim=-1, dtype=torch.float32)  # [B, V]
            return greedy, processed
        # BEGIN LAB 06.4: the random rows: temperature, min_p, top-k / top-p, the draw
        # HINT: receives logits (after apply_logits_processors) and greedy (each row's argmax
        # HINT: of those, or None when every row is random); returns (tokens int64 [B], what
        # HINT: self.topk_topp_sampler returned beside its tokens).
        # HINT: Divide every row by its temperature, in place; when some rows are greedy
        # HINT: (not metadata.all_random) their temperature 0 must not divide: use 1 for any
        # HINT: temperature < _SAMPLING_EPS. Then the argmax-invariant processors (min_p: it
        # HINT: sees the temperature-scaled distribution), then self.topk_topp_sampler(logits,
        # HINT: metadata.generators, metadata.top_k, metadata.top_p). A greedy row keeps its
        # HINT: greedy token (torch.where on metadata.temperature < _SAMPLING_EPS).
        temperature = metadata.temperature
        if not metadata.all_random:
            temperature = torch.where(temperature < _SAMPLING_EPS, 1.0, temperature)  # [B]
        logits = logits.div_(temperature.unsqueeze(1))  # float32 [B, V]
        for processor in metadata.logitsprocs.argmax_invariant:
            logits = processor.apply(logits)
        random, processed = self.topk_topp_sampler(
            logits, metadata.generators, metadata.top_k, metadata.top_p
        )
        if greedy is None:
            return random, processed
        return torch.where(metadata.temperature < _SAMPLING_EPS, greedy, random), processed
        # END LAB 06.4

    @staticmethod
    def greedy_sample(logits: torch.Tensor) -> torch.Tensor:
        """Each row's argmax, int64 [B], as upstream's ``Sampler.greedy_sample``
        (vllm/v1/sample/sampler.py:235). On a CPU, ``argmax`` walks a row one
        logit at a time while ``amax`` is vectorised (UPSTREAM_PIN.md has the
        timing and its command): so find the max of every
        chunk of ``math.gcd(V, 1024)`` logits, the first chunk holding the row's
        max, and the argmax inside that chunk. The index is argmax's: its first
        maximum (its first NaN, if any)."""
        num_rows, vocab = logits.shape
        size = math.gcd(vocab, ARGMAX_CHUNK)
        if logits.device.type != "cpu" or size < 64:
            return logits.argmax(dim=-1)
        chunks = logits.reshape(num_rows, vocab // size, size)  # [B, V / size, size]
        first = chunks.amax(dim=-1).argmax(dim=-1)  # [B]: the first chunk holding the max
        inside = chunks[torch.arange(num_rows), first].argmax(dim=-1)  # [B]
        return first * size + inside

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
