"""Verifying drafts: keep the longest prefix the target model agrees with,
then one token of the target's own.

Mirrors upstream ``vllm/v1/sample/rejection_sampler.py`` at v0.22.1:
``RejectionSampler`` :37 (``forward`` :87, ``_get_logprobs_tensors`` :197,
``parse_output`` :247),
``rejection_sample`` :392, ``apply_sampling_constraints`` :506,
``generate_uniform_probs`` :604, ``sample_recovered_tokens`` :659 and the
Triton kernels they launch (greedy :708, random :762, recovered :854), here
in torch: one loop iteration per request where upstream runs one Triton
program per request.

For a request with drafts ``d_1 .. d_n`` and target rows ``p_1 .. p_n``:

- greedy (temperature 0): position i takes ``argmax p_i``; the request stops
  after the first position where that differs from ``d_i``;
- random: draft ``d_i`` is accepted when ``p_i(d_i) / q_i(d_i) >= u_i``
  (``u_i`` uniform in [0, 1), float64); the first rejected position takes a
  "recovered" token drawn from ``normalize(max(p_i - q_i, 0))``. An n-gram
  draft has no ``q`` (``draft_probs is None``): it counts as ``q(d_i) = 1``
  and ``q = 0`` elsewhere, so acceptance is ``p_i(d_i) >= u_i`` and recovery
  draws from ``p_i`` with ``d_i`` removed (Leviathan et al. 2023, which keeps
  the output distributed exactly as the target's: tests/test_rejection_sampler.py);
- if nothing was rejected, the bonus token (sampled from the row after the
  last draft) follows the drafts.

Output: int32 ``[batch, max_spec_len + 1]``, each row's tokens first, then
``PLACEHOLDER_TOKEN_ID`` (-1). Random numbers are drawn in upstream's order
and with its calls (global ``torch.rand`` then each seeded request's
``uniform_``; global ``exponential_`` then each seeded request's), so with
the same seeds the output equals upstream's token for token on a CPU
(tests/upstream/test_spec_decode_lockstep.py). Recovery uses the exponential
race ``argmax(prob / E)``, ``E ~ Exp(1)`` (one ``E`` row per request, shared
by its positions, as upstream), which needs no normalisation.

Logprobs (``_get_logprobs_tensors``), when some request asked: every output
position gets its own entry, the target row's (raw or processed, as
``logprobs_mode`` says) for a verified or recovered token, the bonus
sampler's own for the bonus token, so they equal a run without drafts.

What is left out (penalties, bad words, min_tokens on draft rows, synthetic
acceptance, the logprobs half of ``parse_output``: the runner keeps each
request's first entries): UPSTREAM_PIN.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mini_vllm.sample.metadata import SamplingMetadata
from mini_vllm.sample.ops.topk_topp_sampler import apply_top_k_top_p
from mini_vllm.sample.sampler import Sampler, SamplerOutput
from mini_vllm.spec_decode.metadata import SpecDecodeMetadata

PLACEHOLDER_TOKEN_ID = -1
GREEDY_TEMPERATURE = 0
# Most drafts one request may carry in one step (upstream's bound too).
MAX_SPEC_LEN = 128


class RejectionSampler:
    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        logprobs_mode = sampler.logprobs_mode
        self.is_processed_logprobs_mode = logprobs_mode.startswith("processed")
        self.is_logits_logprobs_mode = logprobs_mode.endswith("logits")

    def forward(
        self,
        metadata: SpecDecodeMetadata,
        draft_probs: torch.Tensor | None,  # float32 [num_tokens, vocab] or None (n-gram)
        logits: torch.Tensor,  # [num_tokens + batch, vocab]
        sampling_metadata: SamplingMetadata,
    ) -> SamplerOutput:
        """Sample the bonus rows as usual, then verify the drafts against the
        target rows; ``sampled_token_ids`` is the int32 output layout, and
        ``logprobs`` (when some request asked) one entry per output position."""
        if metadata.max_spec_len > MAX_SPEC_LEN:
            raise ValueError(
                f"at most {MAX_SPEC_LEN} drafts per request, got {metadata.max_spec_len}"
            )
        bonus_logits = logits[metadata.bonus_logits_indices]  # [batch, vocab]
        bonus_sampler_output = self.sampler(bonus_logits, sampling_metadata)
        bonus_token_ids = bonus_sampler_output.sampled_token_ids  # [batch]
        raw_target_logits = logits[metadata.target_logits_indices].float()  # [num_tokens, vocab]
        # A new tensor when it filters anything: raw_target_logits stays raw.
        target_logits = apply_sampling_constraints(
            raw_target_logits, metadata.num_draft_tokens, sampling_metadata
        )
        output_token_ids = rejection_sample(
            metadata.draft_token_ids,
            metadata.num_draft_tokens,
            metadata.max_spec_len,
            metadata.cu_num_draft_tokens,
            draft_probs,
            target_logits,
            bonus_token_ids,
            sampling_metadata,
        )
        logprobs = None
        if sampling_metadata.max_num_logprobs is not None:
            logprobs = self._get_logprobs_tensors(
                sampling_metadata.max_num_logprobs,
                metadata,
                target_logits if self.is_processed_logprobs_mode else raw_target_logits,
                bonus_sampler_output.logprobs,
                output_token_ids,
            )
        return SamplerOutput(sampled_token_ids=output_token_ids, logprobs=logprobs)

    __call__ = forward

    def _get_logprobs_tensors(
        self,
        max_num_logprobs: int,
        metadata: SpecDecodeMetadata,
        target_logits: torch.Tensor,  # float32 [num_tokens, vocab], raw or processed by mode
        bonus_logprobs: list[tuple[list[int], list[float], int]],  # [batch], the bonus sampler's
        sampled_token_ids: torch.Tensor,  # int32 [batch, max_spec_len + 1]
    ) -> list[list[tuple[list[int], list[float], int]]]:
        """Per request, one (ids, logprobs, rank) entry per output position:
        position i < n from the request's i-th target row (the distribution
        the token at i was verified or drawn from), position n from its bonus
        row. Positions after a rejection get an entry too (a draft position
        scored for token 0, as upstream; the bonus position the bonus token's);
        the caller keeps as many entries as the request has tokens."""
        target_logprobs = (
            target_logits
            if self.is_logits_logprobs_mode
            else target_logits.log_softmax(dim=-1, dtype=torch.float32)
        )  # [num_tokens, vocab]
        tokens = sampled_token_ids.long()  # [batch, max_spec_len + 1]
        tokens[tokens == PLACEHOLDER_TOKEN_ID] = 0
        # Target row j belongs to request r at position j - (first row of r).
        num_draft_tokens = metadata.num_draft_tokens
        req_of_row = torch.repeat_interleave(torch.tensor(num_draft_tokens))  # [num_tokens]
        starts = metadata.cu_num_draft_tokens.cpu() - torch.tensor(num_draft_tokens)  # [batch]
        pos_of_row = torch.arange(req_of_row.shape[0]) - starts[req_of_row]  # [num_tokens]
        target_entries = self.sampler.gather_logprobs(
            target_logprobs, max_num_logprobs, tokens[req_of_row, pos_of_row]
        )
        entries = []
        for req, n in enumerate(num_draft_tokens):
            start = int(starts[req])
            entries.append(target_entries[start : start + n] + [bonus_logprobs[req]])
        return entries

    @staticmethod
    def parse_output(
        output_token_ids: torch.Tensor,  # int32 [batch, max_spec_len + 1]
        vocab_size: int,
        discard_req_indices: Sequence[int] = (),
    ) -> list[list[int]]:
        """Each request's tokens without the placeholders (and without ids
        >= vocab_size); rows in ``discard_req_indices`` come back empty."""
        out = output_token_ids.cpu().numpy()  # [batch, max_spec_len + 1]
        valid = (out != PLACEHOLDER_TOKEN_ID) & (out < vocab_size)  # [batch, max_spec_len + 1]
        valid[list(discard_req_indices)] = False
        return [row[valid[i]].tolist() for i, row in enumerate(out)]


def apply_sampling_constraints(
    logits: torch.Tensor,  # float32 [num_tokens, vocab]
    num_draft_tokens: list[int],  # [batch]
    sampling_metadata: SamplingMetadata,
) -> torch.Tensor:
    """Temperature, top-k and top-p of each request on each of its target
    rows (greedy requests divide by 1). All-greedy batches: unchanged."""
    if sampling_metadata.all_greedy or logits.shape[0] == 0:
        return logits  # nothing to filter (no drafts: top-k would read an empty batch)
    repeats = torch.tensor(num_draft_tokens)  # [batch]
    temperature = sampling_metadata.temperature.float()  # [batch]
    temperature = torch.where(temperature == GREEDY_TEMPERATURE, 1.0, temperature)
    temperature = temperature.repeat_interleave(repeats)  # [num_tokens]
    logits = logits / temperature.unsqueeze(1)  # [num_tokens, vocab]
    top_k, top_p = sampling_metadata.top_k, sampling_metadata.top_p
    top_k = None if top_k is None else top_k.repeat_interleave(repeats)  # [num_tokens]
    top_p = None if top_p is None else top_p.repeat_interleave(repeats)  # [num_tokens]
    return apply_top_k_top_p(logits, top_k, top_p)


def rejection_sample(
    draft_token_ids: torch.Tensor,  # int [num_tokens]
    num_draft_tokens: list[int],  # [batch]
    max_spec_len: int,
    cu_num_draft_tokens: torch.Tensor,  # int [batch], inclusive
    draft_probs: torch.Tensor | None,  # float32 [num_tokens, vocab] or None
    target_logits: torch.Tensor,  # float32 [num_tokens, vocab], after temperature/top-k/top-p
    bonus_token_ids: torch.Tensor,  # int [batch] or [batch, 1]
    sampling_metadata: SamplingMetadata,
) -> torch.Tensor:
    """The verified tokens, int32 [batch, max_spec_len + 1], -1 padded."""
    batch_size = len(num_draft_tokens)
    num_tokens = draft_token_ids.shape[0]
    if target_logits.shape[0] != num_tokens or sum(num_draft_tokens) != num_tokens:
        raise ValueError(
            f"{num_tokens} draft tokens, {sum(num_draft_tokens)} counted per request, "
            f"{target_logits.shape[0]} target rows: they must agree"
        )
    if draft_probs is not None and draft_probs.shape != target_logits.shape:
        raise ValueError(
            f"draft_probs {tuple(draft_probs.shape)} != target {tuple(target_logits.shape)}"
        )
    device = target_logits.device
    output_token_ids = torch.full(
        (batch_size, max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int32, device=device
    )  # [batch, max_spec_len + 1]
    if sampling_metadata.all_greedy:  # temperature is not read, as upstream
        is_greedy = [True] * batch_size
    else:
        is_greedy = (sampling_metadata.temperature == GREEDY_TEMPERATURE).tolist()  # [batch]
    starts = [
        int(c) - n for c, n in zip(cu_num_draft_tokens.tolist(), num_draft_tokens, strict=True)
    ]
    drafts = draft_token_ids.tolist()  # [num_tokens]
    bonus = bonus_token_ids.reshape(-1).tolist()  # [batch]

    # Drawn before either kind of verification, as upstream.
    uniform_probs = None
    if not sampling_metadata.all_greedy:
        uniform_probs = generate_uniform_probs(
            num_tokens, num_draft_tokens, sampling_metadata.generators, device
        )  # float64 [num_tokens]

    if any(is_greedy):
        # BEGIN LAB 08.3: greedy verification: accept a draft while it is the target's argmax
        # HINT: receives is_greedy, starts (each request's first draft in the flat lists),
        # HINT: num_draft_tokens, drafts, target_logits and bonus; writes the greedy rows of
        # HINT: output_token_ids through _write_row, leaves the others untouched, and leaves
        # HINT: nothing else for later (the code below binds req, start and n afresh).
        # HINT: a rejected greedy position takes the target's argmax instead of the draft.
        target_argmax = target_logits.argmax(dim=-1).tolist()  # [num_tokens]
        for req in range(batch_size):
            if not is_greedy[req]:
                continue
            start, n = starts[req], num_draft_tokens[req]
            accepted = [drafts[start + i] == target_argmax[start + i] for i in range(n)]
            _write_row(
                output_token_ids[req],
                drafts[start : start + n],
                accepted,
                target_argmax[start : start + n],
                bonus[req],
            )
        # END LAB 08.3
        if sampling_metadata.all_greedy:
            return output_token_ids

    target_probs = target_logits.softmax(dim=-1, dtype=torch.float32)  # [num_tokens, vocab]
    recovered_token_ids = sample_recovered_tokens(
        num_draft_tokens, draft_token_ids, draft_probs, target_probs, sampling_metadata
    ).tolist()  # [num_tokens]
    # BEGIN LAB 08.3: the random accept test: p(draft) / q(draft) >= u
    # HINT: receives target_probs, draft_probs (None: an n-gram draft), draft_token_ids
    # HINT: and uniform_probs; leaves accept, a list of num_tokens bools.
    # HINT: an n-gram draft is certain (q(draft) = 1). With draft_probs, a draft its
    # HINT: drafter gave probability 0 is rejected (do not divide by zero).
    rows = torch.arange(num_tokens, device=device)  # [num_tokens]
    draft_ids = draft_token_ids.long()  # [num_tokens]
    target_prob = target_probs[rows, draft_ids]  # float32 [num_tokens]
    if draft_probs is None:
        # An n-gram draft is certain: q(draft) = 1.
        accept = target_prob >= uniform_probs  # [num_tokens]
    else:
        draft_prob = draft_probs[rows, draft_ids]  # float32 [num_tokens]
        # q(draft) = 0 should not happen; reject rather than divide by zero.
        accept = (draft_prob > 0) & (target_prob / draft_prob >= uniform_probs)  # [num_tokens]
    accept = accept.tolist()
    # END LAB 08.3
    for req in range(batch_size):
        if is_greedy[req]:
            continue
        start, n = starts[req], num_draft_tokens[req]
        _write_row(
            output_token_ids[req],
            drafts[start : start + n],
            accept[start : start + n],
            recovered_token_ids[start : start + n],
            bonus[req],
        )
    return output_token_ids


# BEGIN LAB 08.3: one request's output row: accepted drafts, then a replacement or the bonus
def _write_row(
    row: torch.Tensor,  # int32 [max_spec_len + 1], all placeholders
    draft_ids: list[int],  # [n]
    accepted: list[bool],  # [n]
    on_reject: list[int],  # [n]: the token a rejected position takes instead
    bonus_token_id: int,
) -> None:
    """Accepted drafts, then the first rejected position's replacement and
    stop; the bonus token if nothing was rejected."""
    # HINT: write into ``row`` in place (the rest stays PLACEHOLDER_TOKEN_ID).
    for pos, (draft_id, ok) in enumerate(zip(draft_ids, accepted, strict=True)):
        if not ok:
            row[pos] = on_reject[pos]
            return
        row[pos] = draft_id
    row[len(draft_ids)] = bonus_token_id


# END LAB 08.3


def generate_uniform_probs(
    num_tokens: int,
    num_draft_tokens: list[int],  # [batch]
    generators: dict[int, torch.Generator],  # row -> generator, seeded rows only
    device: torch.device,
) -> torch.Tensor:
    """One uniform draw per draft, float64 (float32 draws hit exactly 0.0 too
    often). All from the global generator first, then a seeded request's
    positions are redrawn from its own generator; a request without drafts
    draws nothing from its generator, so its stream stays reproducible."""
    uniform_probs = torch.rand((num_tokens,), dtype=torch.float64, device=device)  # [num_tokens]
    start = 0
    for req, n in enumerate(num_draft_tokens):
        if n == 0:
            continue
        if req in generators:
            uniform_probs[start : start + n].uniform_(generator=generators[req])
        start += n
    return uniform_probs


def sample_recovered_tokens(
    num_draft_tokens: list[int],  # [batch]
    draft_token_ids: torch.Tensor,  # int [num_tokens]
    draft_probs: torch.Tensor | None,  # float32 [num_tokens, vocab] or None
    target_probs: torch.Tensor,  # float32 [num_tokens, vocab]
    sampling_metadata: SamplingMetadata,
) -> torch.Tensor:
    """For every draft position, the token it takes if rejected: a draw from
    ``max(p - q, 0)`` (``p`` without the draft token when there is no ``q``),
    by ``argmax(prob / E)`` with one ``E ~ Exp(1)`` row per request."""
    batch_size, vocab_size = len(num_draft_tokens), target_probs.shape[-1]
    # The exponentials (upstream names them q; here q is the draft's distribution).
    noise = torch.empty((batch_size, vocab_size), dtype=torch.float32, device=target_probs.device)
    noise.exponential_()  # [batch, vocab]
    for req, generator in sampling_metadata.generators.items():
        if num_draft_tokens[req] > 0:
            noise[req].exponential_(generator=generator)
    inv_noise = noise.reciprocal()  # [batch, vocab]

    # BEGIN LAB 08.3: what a rejected position draws from: max(p - q, 0)
    # HINT: receives target_probs, draft_probs (None: an n-gram draft) and draft_token_ids;
    # HINT: leaves prob, [num_tokens, vocab], unnormalised (the race below needs no sum).
    # HINT: an n-gram draft's q is 1 on the draft token and 0 elsewhere. Do not write into
    # HINT: target_probs: the caller reads it again.
    if draft_probs is None:
        rows = torch.arange(draft_token_ids.shape[0], device=target_probs.device)  # [num_tokens]
        prob = target_probs.clone()  # [num_tokens, vocab]
        prob[rows, draft_token_ids.long()] = 0.0
    else:
        prob = (target_probs - draft_probs).clamp(min=0.0)  # [num_tokens, vocab]
    # END LAB 08.3
    repeats = torch.tensor(num_draft_tokens, device=target_probs.device)  # [batch]
    score = prob * inv_noise.repeat_interleave(repeats, dim=0)  # [num_tokens, vocab]
    return score.argmax(dim=-1).to(draft_token_ids.dtype)  # [num_tokens]
