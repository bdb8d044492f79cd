"""Lab 00.1: greedy decoding without and with the KV cache.

Your ``greedy_without_cache`` and ``greedy_with_cache``
(labs/phase_00/kv_cache_speedup.py) run mini_vllm's real model code through
the given ``PagedModel``. Graded:

- both produce exactly transformers' greedy tokens (float32, same weights)
  on a tiny seeded Qwen3, and the reference's tokens on SmolLM2-135M;
- without the cache, step t feeds the whole sequence again (P + t tokens),
  so n tokens cost sum_t (P + t) token-forwards: quadratic in n;
- with the cache, every position is fed exactly once, in order: P + n - 1
  token-forwards in n forwards (the last token is never fed): linear;
- a hypothesis property over prompt lengths and step counts on the tiny model.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mini_vllm.grading.checks import lab_settings

pytestmark = pytest.mark.timeout(120)

TINY_PROMPTS = [[5], [7, 3, 9, 11, 2, 300, 45], [(13 * j + 1) % 512 for j in range(37)]]


def first_difference(got: list[int], expected: list[int]) -> int:
    pairs = enumerate(zip(got, expected, strict=False))
    return next((i for i, (a, b) in pairs if a != b), min(len(got), len(expected)))


def paged(impl, model, max_model_len=128):
    return impl.kv_cache_speedup.PagedModel(model, max_model_len=max_model_len, block_size=16)


def check_tokens(name: str, got: list[int], expected: list[int], prompt: list[int]) -> None:
    assert got == expected, (
        f"{name}(prompt of {len(prompt)} tokens {prompt[:8]}..., max_tokens={len(expected)}) "
        f"returned {got}, transformers' greedy tokens on the same weights are {expected}. "
        "Greedy decoding picks the index of the largest logit at every step and appends it "
        "to the sequence; the first difference is at output index "
        f"{first_difference(got, expected)}."
    )


def run_counted(fn, model, prompt, n):
    """(tokens, positions fed during the call, forwards during the call)."""
    before_pos, before_fwd = len(model.positions_fed), model.num_forwards
    tokens = fn(model, prompt, n)
    return tokens, model.positions_fed[before_pos:], model.num_forwards - before_fwd


@pytest.mark.points(2)
def test_without_cache_matches_transformers_on_tiny_qwen3(impl, tiny_qwen3, hf_greedy):
    _, model, hf = tiny_qwen3
    pm = paged(impl, model)
    for prompt in TINY_PROMPTS:
        got = impl.kv_cache_speedup.greedy_without_cache(pm, prompt, 10)
        check_tokens("greedy_without_cache", got, hf_greedy(hf, prompt, 10), prompt)


@pytest.mark.points(2)
def test_with_cache_matches_transformers_on_tiny_qwen3(impl, tiny_qwen3, hf_greedy):
    _, model, hf = tiny_qwen3
    pm = paged(impl, model)
    for prompt in TINY_PROMPTS:
        got = impl.kv_cache_speedup.greedy_with_cache(pm, prompt, 10)
        check_tokens("greedy_with_cache", got, hf_greedy(hf, prompt, 10), prompt)


@pytest.mark.points(3)
def test_both_match_the_reference_on_smollm2(impl, smollm2):
    """SmolLM2-135M: your tokens against the reference's, run here on the same
    model (the reference equals transformers' greedy tokens: tests/test_kv_cache_speedup.py)."""
    from mini_vllm.benchmarks import kv_cache_speedup as reference

    model, tokenizer = smollm2
    prompt = tokenizer.encode("The capital of France is")
    pm = paged(impl, model, max_model_len=64)
    expected = reference.greedy_with_cache(pm, prompt, 6)
    for fn in (impl.kv_cache_speedup.greedy_with_cache, impl.kv_cache_speedup.greedy_without_cache):
        got = fn(pm, prompt, 6)
        assert got == expected, (
            f"SmolLM2, prompt 'The capital of France is': {fn.__name__} returned {got} "
            f"({tokenizer.decode(got)!r}); greedy decoding gives {expected} "
            f"({tokenizer.decode(expected)!r}). Pick the index of the largest logit at every "
            "step and append it to the sequence."
        )


@pytest.mark.points(2)
def test_without_cache_recomputes_the_whole_sequence_every_step(impl, tiny_qwen3):
    _, model, _ = tiny_qwen3
    pm = paged(impl, model)
    prompt, n = TINY_PROMPTS[1], 6
    _, positions, forwards = run_counted(impl.kv_cache_speedup.greedy_without_cache, pm, prompt, n)
    p = len(prompt)
    expected = [pos for t in range(n) for pos in range(p + t)]
    assert len(positions) == len(expected), (
        f"without a KV cache, step t must feed the whole sequence so far (P + t tokens), so "
        f"{n} tokens after a {p}-token prompt cost sum over t of (P + t) = {len(expected)} "
        f"token-forwards; yours fed {len(positions)}. That sum grows with n squared: the "
        "quadratic cost the KV cache removes."
    )
    assert positions == expected and forwards == n, (
        f"without a KV cache each of the {n} steps is one prefill from position 0 to the "
        f"sequence's end (positions {expected[:p]}, then {expected[p : 2 * p + 1]}, ...); "
        f"yours fed positions {positions[: 3 * p]}... in {forwards} forwards."
    )


@pytest.mark.points(2)
def test_with_cache_feeds_each_position_once(impl, tiny_qwen3):
    _, model, _ = tiny_qwen3
    pm = paged(impl, model)
    prompt, n = TINY_PROMPTS[1], 6
    _, positions, forwards = run_counted(impl.kv_cache_speedup.greedy_with_cache, pm, prompt, n)
    p = len(prompt)
    assert len(positions) == p + n - 1, (
        f"with the KV cache the prompt is fed once ({p} tokens) and then each step feeds only "
        f"the newest token; the last sampled token is never fed, so {n} tokens cost "
        f"P + n - 1 = {p + n - 1} token-forwards (linear in n). Yours fed {len(positions)} "
        f"(without a cache it would be {sum(p + t for t in range(n))})."
    )
    assert positions == list(range(p + n - 1)), (
        "with the KV cache no position is ever computed twice: the keys and values of earlier "
        f"positions do not change. Expected positions 0..{p + n - 2} in order, each once; "
        f"yours fed {positions}."
    )
    assert forwards == n, (
        f"expected {n} forwards (one prefill of the prompt, then one per new token but the "
        f"last); yours made {forwards}."
    )


@pytest.mark.points(3)
def test_property_prompt_lengths_and_steps(impl, tiny_qwen3, hf_greedy, monkeypatch):
    # Past this, hypothesis stops shrinking a failure and reports the smallest
    # failing example found so far, so a failing property ends quickly.
    from hypothesis.internal.conjecture import engine

    monkeypatch.setattr(engine, "MAX_SHRINKING_SECONDS", 10, raising=False)
    _, model, hf = tiny_qwen3
    fns = impl.kv_cache_speedup
    pm = paged(impl, model, max_model_len=64)
    fns.greedy_with_cache(pm, [1, 2, 3], 2)  # an unwritten lab fails here, before hypothesis

    @lab_settings(10, shrink=True)
    @given(prompt=st.lists(st.integers(3, 511), min_size=1, max_size=24), n=st.integers(1, 8))
    def prop(prompt, n):
        expected = hf_greedy(hf, prompt, n)
        p = len(prompt)
        tokens, positions, _ = run_counted(fns.greedy_with_cache, pm, prompt, n)
        check_tokens("greedy_with_cache", tokens, expected, prompt)
        assert positions == list(range(p + n - 1)), (
            f"with the KV cache, prompt of {p} tokens, {n} new tokens: positions 0..{p + n - 2} "
            f"must each be fed once, in order; yours fed {positions}"
        )
        tokens, positions, _ = run_counted(fns.greedy_without_cache, pm, prompt, n)
        check_tokens("greedy_without_cache", tokens, expected, prompt)
        assert len(positions) == sum(p + t for t in range(n)), (
            f"without the KV cache, prompt of {p} tokens, {n} new tokens: expected "
            f"sum of (P + t) = {sum(p + t for t in range(n))} token-forwards, yours fed "
            f"{len(positions)}"
        )

    prop()
