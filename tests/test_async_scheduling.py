"""Async scheduling on real models: the same tokens with it on and off.

With ``async_scheduling=True`` the engine core schedules step N+1 before
step N's tokens are back (``EngineCore.step_with_batch_queue``) and the
``AsyncScheduler`` counts the missing tokens as placeholders. Greedy decoding
must not notice: every request gets the tokens, text and finish reason the
synchronous engine gives it, including requests that stop (EOS, a stop
token, a stop string) while their next step is already scheduled, requests
that hit max_tokens (the scheduler must not run a step past it), aborts with
a step in flight, and preemption. The scheduler-level proof, step for step
against upstream, is tests/upstream/test_lockstep.py.
"""

from __future__ import annotations

import pytest

import mini_vllm.testing as mini
from mini_vllm.engine.llm_engine import LLMEngine
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.model_executor.model_loader import smollm2_gguf_path
from mini_vllm.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "Hello, my name is", "1, 2, 3,", "def fib(n):"]


def _outputs(llm: LLM, params: list[SamplingParams]) -> list[tuple]:
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [
        (
            o.outputs[0].token_ids,
            o.outputs[0].text,
            o.outputs[0].finish_reason,
            o.outputs[0].stop_reason,
        )
        for o in outs
    ]


@pytest.fixture(scope="module")
def smollm2_llms():
    """(sync LLM, async LLM) on SmolLM2; each loads the GGUF once (~2 s quiet)."""
    path = smollm2_gguf_path()
    kwargs = dict(max_model_len=256, kv_cache_memory_bytes=32 << 20)
    return LLM(str(path), **kwargs), LLM(str(path), async_scheduling=True, **kwargs)


def test_async_scheduler_and_batch_queue_are_used(smollm2_llms):
    from mini_vllm.core.sched.async_scheduler import AsyncScheduler

    sync, asyn = smollm2_llms
    assert type(sync.llm_engine.engine_core.scheduler).__name__ == "Scheduler"
    assert sync.llm_engine.engine_core.batch_queue is None
    assert isinstance(asyn.llm_engine.engine_core.scheduler, AsyncScheduler)
    assert asyn.llm_engine.engine_core.batch_queue.maxlen == 2


def test_same_greedy_tokens_with_stops_landing_on_scheduled_steps(smollm2_llms):
    sync, asyn = smollm2_llms
    # max_tokens 1 and 2: the scheduler must skip the step after the last
    # token (the request's next step would run past max_tokens).
    free = [SamplingParams(max_tokens=m, temperature=0) for m in (1, 2, 12, 20)]
    base = _outputs(sync, free)
    assert _outputs(asyn, free) == base

    # Stops chosen from the synchronous run itself: the 4th token of prompt
    # 2 as a stop token, a piece of prompt 3's text as a stop string, and
    # prompt 0 stops on EOS if the model emits it (else by length).
    stop_token = base[2][0][3]
    stop_string = base[3][1][len(base[3][1]) // 2 :][:4]
    assert stop_string.strip(), base[3][1]
    stopping = [
        SamplingParams(max_tokens=12, temperature=0),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_token]),
        SamplingParams(max_tokens=20, temperature=0, stop=[stop_string]),
    ]
    expected = _outputs(sync, stopping)
    got = _outputs(asyn, stopping)
    assert got == expected
    # The stops really stopped early (else this test proves nothing about them).
    assert expected[2][2] == "stop" and expected[2][3] == stop_token
    assert expected[3][2] == "stop" and expected[3][3] == stop_string
    # Nothing is left behind: every KV block is free again.
    for llm in smollm2_llms:
        core = llm.llm_engine.engine_core
        pool = core.scheduler.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == core.vllm_config.cache_config.num_gpu_blocks - 1


def _run_with_abort(engine: LLMEngine, abort_after: int) -> dict:
    """Four greedy requests; request 'b' is aborted once it has
    ``abort_after`` tokens. Returns each request's tokens."""
    tokens: dict[str, list[int]] = {}
    for rid, prompt in zip("abcd", PROMPTS, strict=True):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=10, temperature=0))
    aborted = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
        if not aborted and len(tokens.get("b", ())) >= abort_after:
            engine.abort_request("b")
            aborted = True
    assert aborted
    return tokens


def test_abort_with_a_step_in_flight(smollm2_llms):
    sync, asyn = smollm2_llms
    expected = _run_with_abort(sync.llm_engine, 3)
    got = _run_with_abort(asyn.llm_engine, 3)
    assert len(expected["b"]) == 3
    assert got == expected
    core = asyn.llm_engine.engine_core
    assert not core.scheduler.requests
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == core.vllm_config.cache_config.num_gpu_blocks - 1


def test_preemption_same_tokens(tiny_qwen3):
    """A tiny random model and a KV cache too small for all requests at once:
    requests are preempted and resumed, with tokens in flight."""
    folder, _ = tiny_qwen3
    kwargs = dict(max_model_len=24, num_gpu_blocks_override=9, block_size=4, max_num_seqs=4)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = [[5 + i, 17, 23 + i, 4, 9, 11 + 2 * i] for i in range(4)]
    results = []
    for async_scheduling in (False, True):
        llm = LLM(folder, async_scheduling=async_scheduling, **kwargs)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results.append(([o.outputs[0].token_ids for o in outs], llm.llm_engine.get_stats()))
    (sync_tokens, sync_stats), (async_tokens, async_stats) = results
    assert sync_stats["num_preemptions"] > 0, sync_stats
    assert all(len(t) == 16 for t in sync_tokens)
    assert async_tokens == sync_tokens


def test_async_scheduling_must_be_a_bool():
    """A truthy string is not a setting: refused by name, not read as on."""
    with pytest.raises(ValueError, match="async_scheduling must be True or False, got 'yes'"):
        mini.create_scheduler(async_scheduling="yes")
