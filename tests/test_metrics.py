"""Phase 18: /metrics counts what the engine did.

A workload on the tiny model through ``AsyncLLM`` (the engine behind the
server's /metrics) with a KV cache small enough to preempt and prompts that
share a prefix. What the run did is counted on the side, from what the
scheduler decided (its ``SchedulerOutput``s: preemptions, first admissions'
cached tokens; the prefix-cache lookups' answers) and from what the callers
got back (tokens, finish reasons); the exposition ``render()`` returns
(what /metrics serves) must say the same.
"""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import tiny_text_model

from mini_vllm.engine.async_llm import AsyncLLM
from mini_vllm.sampling_params import SamplingParams

NUM_REQUESTS = 6
MAX_TOKENS = 12
PREFIX = list(range(100, 120))  # 5 full blocks of 4, shared by every prompt


def samples(engine: AsyncLLM) -> dict[tuple[str, tuple], float]:
    text = engine.stat_logger.render().decode()
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.fixture(scope="module")
def run():
    """The engine after the workload, what the scheduler decided, and the outputs."""
    engine = AsyncLLM.from_model(
        tiny_text_model(),
        model_name="tiny",
        num_gpu_blocks_override=12,
        block_size=4,
        max_num_seqs=8,
        max_model_len=44,
    )
    scheduler = engine.llm_engine.engine_core.scheduler
    seen = {"preemptions": 0, "first_cached": {}, "queries": 0, "hits": 0}

    schedule = scheduler.schedule

    def recording_schedule():
        out = schedule()
        seen["preemptions"] += len(out.preempted_req_ids or ())
        for new in out.scheduled_new_reqs:
            seen["first_cached"].setdefault(new.req_id, new.num_computed_tokens)
        return out

    lookup = scheduler.kv_cache_manager.get_computed_blocks

    def recording_lookup(request):
        blocks, num_hits = lookup(request)
        if request.num_preemptions == 0:  # upstream counts resumed requests apart
            seen["queries"] += request.num_tokens
            seen["hits"] += num_hits
        return blocks, num_hits

    scheduler.schedule = recording_schedule
    scheduler.kv_cache_manager.get_computed_blocks = recording_lookup
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    prompts = [[*PREFIX, 200 + i, 7, 8] for i in range(NUM_REQUESTS)]

    async def one(i):
        outputs = [out async for out in engine.generate(prompts[i], params, f"r{i}")]
        return outputs[-1]

    async def main():
        try:
            return await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)))
        finally:
            engine.shutdown()  # while the loop runs (AsyncLLM.shutdown)

    outputs = asyncio.run(main())
    return engine, seen, prompts, outputs


def test_counters_equal_what_the_run_did(run):
    engine, seen, prompts, outputs = run
    # The run is the one this test needs (else it proves less).
    assert seen["preemptions"] > 0, "no preemption: the KV cache is too large for this test"
    assert seen["hits"] > 0, "no prefix-cache hit: the prompts share no full block"
    got = samples(engine)
    num_prompt = sum(len(p) for p in prompts)
    num_generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    cached = sum(seen["first_cached"].values())
    expected = {
        "vllm:num_preemptions_total": seen["preemptions"],
        "vllm:prefix_cache_queries_total": seen["queries"],
        "vllm:prefix_cache_hits_total": seen["hits"],
        "vllm:prompt_tokens_total": num_prompt,
        "vllm:prompt_tokens_cached_total": cached,
        "vllm:generation_tokens_total": num_generated,
    }
    for name, value in expected.items():
        assert got[(name, (("engine", "0"),))] == value, f"{name}: the run did {value}"
    by_source = {"local_compute": num_prompt - cached, "local_cache_hit": cached}
    for source, value in by_source.items():
        key = ("vllm:prompt_tokens_by_source_total", (("engine", "0"), ("source", source)))
        assert got[key] == value, f"prompt tokens from {source}: the run had {value}"
    success = ("vllm:request_success_total", (("engine", "0"), ("finished_reason", "length")))
    assert got[success] == NUM_REQUESTS, "every request stopped at max_tokens"
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert got[(name, (("engine", "0"),))] == 0, f"{name} after the run"


def test_get_stats_totals_under_async_llm(run):
    """``LLMEngine.get_stats`` counts what the served engine did, as it does
    under ``LLM`` (it read zero prefix-cache queries when AsyncLLM drove it)."""
    engine, seen, _, _ = run
    stats = engine.llm_engine.get_stats()
    assert stats["prefix_cache_queries"] == seen["queries"]
    assert stats["prefix_cache_hits"] == seen["hits"]
    assert stats["num_preemptions"] == seen["preemptions"]


def test_histograms_count_every_request_and_token(run):
    engine, _, prompts, outputs = run
    got = samples(engine)
    num_generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    per_request = (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
        "request_time_per_output_token_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    )
    for name in per_request:
        count = got[(f"vllm:{name}_count", (("engine", "0"),))]
        assert count == NUM_REQUESTS, f"vllm:{name}: one sample per request, got {count}"
    # One inter-token latency per output after a request's first (one token a step here).
    itl = got[("vllm:inter_token_latency_seconds_count", (("engine", "0"),))]
    assert itl == num_generated - NUM_REQUESTS
    sums = {
        "request_prompt_tokens": sum(len(p) for p in prompts),
        "request_generation_tokens": num_generated,
        "request_params_max_tokens": NUM_REQUESTS * MAX_TOKENS,
    }
    for name, value in sums.items():
        assert got[(f"vllm:{name}_sum", (("engine", "0"),))] == value, f"vllm:{name}"
    # Per request, inference = prefill + decode (the same timestamps).
    prefill, decode, inference = (
        got[(f"vllm:request_{part}_time_seconds_sum", (("engine", "0"),))]
        for part in ("prefill", "decode", "inference")
    )
    assert inference == pytest.approx(prefill + decode, rel=1e-9, abs=1e-9)
