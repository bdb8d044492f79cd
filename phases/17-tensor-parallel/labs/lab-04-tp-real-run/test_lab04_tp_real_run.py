"""Lab 17.4 — a model split over processes generates what it generates whole.

No new code: every Phase 17 region is yours (the ``phase`` marker). Your
collectives, parallel linears, head split, vocabulary-parallel embedding
and executor run in mini_vllm's engine: ``LLM(...,
tensor_parallel_size=N, distributed_executor_backend="mp")`` takes your
``MultiprocExecutor``, and each worker process it spawns loads your code
before it builds its slice of the model (``tp_checks.GradedWorkerProc``).
Greedy tokens must equal the same engine's with one process (your layers,
whole) and transformers' on the same weights:

- every tier: the tiny seeded Llama (4 query heads, 2 KV heads) with TP=2;
  each rank's KV cache holds one KV head;
- then, in the deep tier (``make check-phase-17`` unless
  MINI_VLLM_TIER=fast; mini_vllm/tiers.py): SmolLM2-135M (9 query heads,
  3 KV heads) with TP=3, one KV head a rank, on two prompts (one through
  its chat template).
"""

from __future__ import annotations

import pytest
import torch
from phase17_helpers import KV_BYTES, NUM_TOKENS, prompts

from mini_vllm.grading.checks import written
from mini_vllm.grading.tp_checks import graded_lab, installed
from mini_vllm.tiers import tier

pytestmark = [pytest.mark.phase, pytest.mark.timeout(900)]


def yours(impl, path, tp: int, **kwargs):
    """An LLM built with your Phase 17 (its workers too)."""
    from mini_vllm.entrypoints.llm import LLM

    with installed(impl), graded_lab("17"):
        return written(
            LLM,
            str(path),
            tensor_parallel_size=tp,
            distributed_executor_backend="mp" if tp > 1 else None,
            **kwargs,
        )


def greedy_tokens(llm, prompt_ids: list[list[int]]) -> list[list[int]]:
    from mini_vllm.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = written(
        llm.generate, [{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False
    )
    return [list(o.outputs[0].token_ids) for o in outputs]


def check_run(impl, path, tp: int, prompt_ids, expected, whole=None, **kwargs) -> None:
    whole = whole or yours(impl, path, 1, **kwargs)
    got = greedy_tokens(whole, prompt_ids)
    assert got == expected, f"TP=1 (your layers, whole) sampled {got}, transformers {expected}"
    spec1 = whole.llm_engine.engine_core.kv_cache_spec
    del whole
    split = yours(impl, path, tp, **kwargs)
    try:
        got = greedy_tokens(split, prompt_ids)
        for i, (mine, want) in enumerate(zip(got, expected, strict=True)):
            assert mine == want, (
                f"prompt {i}: TP={tp} sampled {mine}, TP=1 and transformers {want}: a split "
                "layer, the head split or a collective differs from the whole model"
            )
        spec = split.llm_engine.engine_core.kv_cache_spec
        assert spec.num_kv_heads * tp == max(spec1.num_kv_heads, tp), (
            f"each rank's KV cache holds {spec.num_kv_heads} KV heads of {spec1.num_kv_heads} "
            f"over {tp} ranks: its own heads only"
        )
    finally:
        split.llm_engine.engine_core.shutdown()


def smollm2_run(impl) -> None:
    """SmolLM2 at TP=3 against TP=1 (its tokenizer gives the prompts) and transformers."""
    from transformers import AutoModelForCausalLM

    from mini_vllm.model_executor.model_loader import smollm2_gguf_path
    from mini_vllm.testing import hf_greedy

    path = smollm2_gguf_path()
    kwargs = {"kv_cache_memory_bytes": 64 * 2**20, "max_model_len": 256}
    whole = yours(impl, path, 1, **kwargs)
    tokenizer = whole.get_tokenizer()
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompt_ids = [tokenizer("The capital of France is")["input_ids"], tokenizer(chat)["input_ids"]]
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    expected = [hf_greedy(hf, p, NUM_TOKENS) for p in prompt_ids]
    del hf
    check_run(impl, path, 3, prompt_ids, expected, whole=whole, **kwargs)


@pytest.mark.points(10)
def test_tp_runs_equal_tp1_and_transformers(tiny_llama, impl):
    path, expected = tiny_llama
    check_run(impl, path, 2, prompts(), expected, kv_cache_memory_bytes=KV_BYTES, max_model_len=128)
    if tier() == "deep":
        smollm2_run(impl)
