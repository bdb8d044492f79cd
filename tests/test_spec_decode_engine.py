"""N-gram speculation through the whole engine leaves greedy tokens unchanged.

With ``speculative_config`` the runner drafts after every step, verifies the
drafts in the next forward pass and the scheduler rolls back the rejected
ones; under greedy sampling the tokens must be exactly those of a run
without speculation and of transformers' greedy loop. Each test also checks
from the engine's spec-decode stats that drafts were both accepted and
rejected, so it cannot pass with speculation silently doing nothing.
(Random-mode acceptance keeps the target's distribution:
tests/test_rejection_sampler.py.)
"""

from __future__ import annotations

from hf_reference import hf_greedy

from mini_vllm.entrypoints.llm import LLM
from mini_vllm.sampling_params import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


def _generate(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def _assert_drafts_accepted_and_rejected(llm: LLM) -> dict:
    stats = llm.llm_engine.get_stats()
    accepted, drafted = stats["spec_num_accepted_tokens"], stats["spec_num_draft_tokens"]
    assert accepted > 0, f"no draft was accepted: {stats}"
    assert drafted > accepted, f"no draft was rejected: {stats}"
    per_pos = stats["spec_num_accepted_tokens_per_pos"]
    assert per_pos == sorted(per_pos, reverse=True) and sum(per_pos) == accepted, stats
    return stats


def test_smollm2_greedy_with_speculation_equals_without_and_transformers(smollm2_hf):
    path, hf = smollm2_hf
    plain = LLM(str(path), max_model_len=256, kv_cache_memory_bytes=32 << 20)
    tok = plain.get_tokenizer()
    prompts = [
        # Repetitive: the model continues the pattern, so drafts are accepted.
        tok.encode("red, green, blue, red, green, blue, red, green, blue, red,"),
        tok.encode("The capital of France is"),
    ]
    n = 20
    expected = [hf_greedy(hf, p, n) for p in prompts]
    assert _generate(plain, prompts, n) == expected
    spec = LLM(
        str(path), max_model_len=256, kv_cache_memory_bytes=32 << 20, speculative_config=NGRAM
    )
    assert _generate(spec, prompts, n) == expected
    _assert_drafts_accepted_and_rejected(spec)
    assert spec.llm_engine.get_stats()["num_steps"] < plain.llm_engine.get_stats()["num_steps"]


def _repetitive_prompts(vocab: int) -> list[list[int]]:
    """Prompts built from short repeated patterns (so the tiny model's
    contexts hold n-grams to match), of different lengths."""
    return [[(11 * i + j) % vocab for j in range(3 + i % 2)] * (6 + i) for i in range(4)]


def test_speculation_with_preemption_matches_transformers(tiny_qwen3):
    path, hf = tiny_qwen3
    # 7 usable blocks of 16 tokens for four 18-32-token prompts growing by 40.
    llm = LLM(
        path, max_model_len=96, num_gpu_blocks_override=8, block_size=16, speculative_config=NGRAM
    )
    prompts = _repetitive_prompts(llm.llm_engine.hf_config.vocab_size)
    n = 40
    assert _generate(llm, prompts, n) == [hf_greedy(hf, p, n) for p in prompts]
    stats = _assert_drafts_accepted_and_rejected(llm)
    assert stats["num_preemptions"] > 0, "the cache was meant to be too small"


def test_speculation_with_chunked_prefill_and_a_small_budget_matches_transformers(tiny_qwen3):
    path, hf = tiny_qwen3
    # 8 tokens a step for up to 4 requests: prompts are chunked, and drafts
    # are cut to what the budget leaves.
    llm = LLM(
        path,
        max_model_len=128,
        kv_cache_memory_bytes=8 << 20,
        max_num_batched_tokens=8,
        max_num_seqs=4,
        speculative_config=NGRAM,
    )
    prompts = _repetitive_prompts(llm.llm_engine.hf_config.vocab_size)
    n = 30
    assert _generate(llm, prompts, n) == [hf_greedy(hf, p, n) for p in prompts]
    _assert_drafts_accepted_and_rejected(llm)


def test_logprobs_with_speculation_are_one_entry_per_token_as_without(tiny_qwen3):
    """Every generated token carries its own logprobs entry (its logprob
    first, then the top 3), equal to the same greedy request's without
    speculation, also for the tokens accepted from drafts and the bonus token
    (upstream: RejectionSampler._get_logprobs_tensors). One request asks for
    none: it gets none, and its tokens do not shift the others' entries."""
    path, _ = tiny_qwen3
    args = dict(max_model_len=128, kv_cache_memory_bytes=8 << 20)
    plain, spec = LLM(path, **args), LLM(path, **args, speculative_config=NGRAM)
    prompts = _repetitive_prompts(plain.llm_engine.hf_config.vocab_size)
    params = [
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=k)
        for k in (3, None, 0, 3)
    ]

    def run(llm: LLM):
        inputs = [{"prompt_token_ids": p} for p in prompts]
        return [o.outputs[0] for o in llm.generate(inputs, params, use_tqdm=False)]

    want, got = run(plain), run(spec)
    _assert_drafts_accepted_and_rejected(spec)
    for w, g, p in zip(want, got, params, strict=True):
        assert g.token_ids == w.token_ids
        if p.logprobs is None:
            assert g.logprobs is None and w.logprobs is None
            continue
        assert len(g.logprobs) == len(g.token_ids) == len(w.logprobs)
        for token, g_entry, w_entry in zip(g.token_ids, g.logprobs, w.logprobs, strict=True):
            assert next(iter(g_entry)) == token  # the sampled token's own logprob first
            assert list(g_entry) == list(w_entry)
            for token_id, logprob in w_entry.items():
                assert abs(g_entry[token_id] - logprob) < 1e-4, (token, token_id)
        assert abs(g.cumulative_logprob - w.cumulative_logprob) < 1e-3
