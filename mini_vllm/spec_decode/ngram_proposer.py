"""N-gram (prompt-lookup) drafts: guess the next tokens by finding the
context's own ending earlier in the context and copying what followed it.

Mirrors upstream ``vllm/v1/spec_decode/ngram_proposer.py`` (``NgramProposer``
:12, ``propose`` :131, ``_find_longest_matched_ngram_and_propose_tokens``
:199) at v0.22.1, with the same result for every input (the live lockstep in
tests/upstream/test_spec_decode_lockstep.py checks it against upstream's).

The rule, for one request whose context is ``tokens`` (length ``T``):

- look for the longest ``n`` in ``[prompt_lookup_min, prompt_lookup_max]``
  such that the last ``n`` tokens also appear starting at some ``j`` with
  ``j + n < T`` (an earlier start; the occurrence may overlap the ending);
- among those occurrences take the EARLIEST ``j``;
- draft ``tokens[j + n : j + n + k]`` with ``k = min(num_speculative_tokens,
  max_model_len - T)``; fewer if the context ends first (never empty: the
  occurrence ends before ``T``).

No match of at least ``prompt_lookup_min`` tokens, a context shorter than
that, or a request already at ``max_model_len``: no draft (an empty list).

Upstream finds the match with one KMP scan over the reversed context (numba
compiled, O(T)). Here it is plain numpy, one vectorised comparison per
candidate ``n`` from the longest down (O(T * n) work for each ``n``), because it
reads as the rule above; it is slower for long contexts, which a teaching
engine can afford. Upstream's scan keeps the last of equally long matches in
reversed order, which is the earliest in the original order, as here.

Invariants: drafts are lists of ints; a request with no sampled tokens this
step (still prefilling) gets no draft; one list per request, in batch order.
What is left out (numba threads, buffers, the config object): UPSTREAM_PIN.md.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(
        self,
        prompt_lookup_min: int,
        prompt_lookup_max: int,
        num_speculative_tokens: int,
        max_model_len: int,
    ):
        if prompt_lookup_min < 1 or prompt_lookup_max < prompt_lookup_min:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"prompt_lookup_min={prompt_lookup_min}, prompt_lookup_max={prompt_lookup_max}"
            )
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,  # int [batch]
        token_ids_cpu: np.ndarray,  # int [batch, >= max context length]
    ) -> list[list[int]]:
        """One draft per request: ``[]`` where the request sampled nothing
        this step, already holds ``max_model_len`` tokens, or has no match."""
        drafts: list[list[int]] = []
        for i, sampled_ids in enumerate(sampled_token_ids):
            num_tokens = int(num_tokens_no_spec[i])
            # BEGIN LAB 08.2: who gets no draft at all
            # HINT: receives sampled_ids (this row's tokens sampled this step) and num_tokens
            # HINT: (its context length); appends [] to drafts and moves on (continue) for a
            # HINT: row that sampled nothing (still prefilling) or already holds max_model_len
            # HINT: tokens; otherwise does nothing.
            if not sampled_ids or num_tokens >= self.max_model_len:
                drafts.append([])
                continue
            # END LAB 08.2
            context = token_ids_cpu[i, :num_tokens]  # [num_tokens]
            drafts.append(self.propose_one(context).tolist())
        return drafts

    # BEGIN LAB 08.2: the longest n-gram match, its earliest occurrence, k tokens after it
    def propose_one(self, tokens: np.ndarray) -> np.ndarray:
        """The draft for one context ``tokens`` (1-D); may be empty."""
        # HINT: k = num_speculative_tokens, capped so that the context plus the draft
        # HINT: never passes self.max_model_len; nothing to do if the context is shorter
        # HINT: than self.min_n or k is 0. Return a 1-D slice of ``tokens`` (tokens[:0]: empty).
        # HINT: try n from the longest (self.max_n, but the ending must also occur EARLIER,
        # HINT: starting before position total - n) down to self.min_n; the first n with a
        # HINT: match wins. Among its occurrences take the EARLIEST, and draft the k tokens
        # HINT: that follow it (fewer if the context ends first).
        # HINT: numpy.lib.stride_tricks.sliding_window_view(a, n) gives every window of n.
        total = tokens.shape[0]
        k = min(self.k, self.max_model_len - total)
        if total < self.min_n or k <= 0:
            return tokens[:0]
        # Longest n first; n = total would need an occurrence starting before 0.
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            suffix = tokens[total - n :]  # [n]
            # Every window of n tokens that starts at j = 0 .. total - n - 1.
            windows = sliding_window_view(tokens[: total - 1], n)  # [total - n, n]
            starts = np.flatnonzero((windows == suffix).all(axis=1))  # [num_matches]
            if starts.size:
                start = int(starts[0]) + n  # the earliest occurrence
                return tokens[start : start + k]
        return tokens[:0]

    # END LAB 08.2
