"""NgramProposer follows the rule its module docstring states, checked
against a brute-force reading of that rule (no upstream needed; the
equality with upstream's proposer is in tests/upstream/test_spec_decode_lockstep.py).

The rule: the longest n in [min_n, max_n] whose last-n tokens occur starting
earlier (start + n < T), the earliest such start, then up to
min(k, max_model_len - T) tokens after it.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_vllm.spec_decode.ngram_proposer import NgramProposer


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int, max_model_len: int) -> list[int]:
    total = len(tokens)
    k = min(k, max_model_len - total)
    if k <= 0:
        return []
    for n in range(max_n, min_n - 1, -1):
        for start in range(total - n):  # start + n < total
            if tokens[start : start + n] == tokens[total - n :]:
                return tokens[start + n : start + n + k]
    return []


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    min_n=st.integers(1, 4),
    extra=st.integers(0, 3),
    k=st.integers(1, 5),
    max_model_len=st.integers(1, 24),
    tokens=st.lists(st.integers(0, 2), max_size=24),
    sampled=st.booleans(),
)
def test_propose_follows_the_documented_rule(min_n, extra, k, max_model_len, tokens, sampled):
    tokens = tokens[:max_model_len]
    max_n = min_n + extra
    row = np.zeros((1, max_model_len), dtype=np.int32)  # [batch, max_model_len]
    row[0, : len(tokens)] = tokens
    num_tokens = np.array([len(tokens)], dtype=np.int32)  # [batch]
    proposer = NgramProposer(min_n, max_n, k, max_model_len)
    got = proposer.propose([[1] if sampled else []], num_tokens, row)
    want = brute_force(tokens, min_n, max_n, k, max_model_len) if sampled else []
    assert got == [want]
