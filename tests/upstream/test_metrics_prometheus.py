"""Phase 18: mini_vllm's Prometheus logger against upstream's, sample by sample.

Upstream's ``PrometheusStatLogger`` (vllm/v1/metrics/loggers.py:404), built
on this CPU from a ``VllmConfig``, and mini_vllm's are fed the same steps'
stats (mini_vllm's objects, converted field by field by
``mini_vllm.oracle.prometheus.to_upstream``). Their expositions must agree
on every ``vllm:`` family both have: type, help text, and every sample
(name, labels, value; histogram buckets, counts and sums), ``_created``
timestamps aside. Every family upstream has and mini_vllm does not must be
one mini_vllm leaves out on purpose (``LEFT_OUT``).

The stats come from two places: generated steps (values on and around the
bucket bounds, every finish reason, drafts at every position), and the steps
of a real run of the tiny model through ``AsyncLLM`` with n-gram speculation
on, a small KV cache (preemptions) and a shared prefix, recorded as the
engine's own logger got them. (The tiny model's random outputs never repeat
a context token, so its drafter proposes nothing: the spec-decode samples
of the real run stay 0, and the generated steps carry the drafts.)

The stats themselves are graded too: the same generated outputs (tokens,
events, prefill stats, timestamps, finishes) go through mini_vllm's
``IterationStats`` and upstream's (vllm/v1/metrics/stats.py:325), which must
agree field by field, step by step, with every request's timestamps.
"""

from __future__ import annotations

import asyncio
import copy
import random

import pytest
from serve_helpers import tiny_text_model

from mini_vllm.config import ModelConfig, SpeculativeConfig, VllmConfig
from mini_vllm.engine import FinishReason
from mini_vllm.engine.async_llm import AsyncLLM
from mini_vllm.metrics.loggers import (
    REQUEST_LATENCY_BUCKETS,
    TOKEN_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    PrometheusStatLogger,
    build_1_2_5_buckets,
)
from mini_vllm.metrics.stats import (
    FinishedRequestStats,
    IterationStats,
    PrefixCacheStats,
    PromptTokenStats,
    SchedulerStats,
)
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.spec_decode.metrics import SpecDecodingStats

pytestmark = pytest.mark.upstream

oracle = pytest.importorskip("mini_vllm.oracle.prometheus")

MODEL = "tiny"
MAX_MODEL_LEN = 44


def compare(steps, max_model_len: int, num_spec: int | None) -> None:
    """Feed ``steps`` [(SchedulerStats | None, IterationStats | None)] to both
    loggers and compare their expositions."""
    speculative = None if num_spec is None else SpeculativeConfig(num_speculative_tokens=num_spec)
    config = VllmConfig(
        model_config=ModelConfig(max_model_len=max_model_len), speculative_config=speculative
    )
    mini = PrometheusStatLogger(config, MODEL)
    upstream = oracle.upstream_logger(max_model_len, MODEL, num_spec)
    for scheduler_stats, iteration_stats in steps:
        mini.record(copy.deepcopy(scheduler_stats), copy.deepcopy(iteration_stats))
        upstream.record(*oracle.to_upstream(scheduler_stats, iteration_stats))
    got = oracle.exposition(mini.render().decode())
    want = oracle.upstream_exposition()
    missing = sorted(set(want) - set(got) - set(oracle.LEFT_OUT))
    assert not missing, f"upstream has these metrics and mini_vllm does not: {missing}"
    extra = sorted(set(got) - set(want))
    assert not extra, f"mini_vllm has metrics upstream does not: {extra}"
    for name, (kind, doc, samples) in got.items():
        want_kind, want_doc, want_samples = want[name]
        assert (kind, doc) == (want_kind, want_doc), f"{name}: type or help text differs"
        assert samples.keys() == want_samples.keys(), (
            f"{name}: samples differ: mini only {sorted(samples.keys() - want_samples.keys())}, "
            f"upstream only {sorted(want_samples.keys() - samples.keys())}"
        )
        for key, value in samples.items():
            assert value == want_samples[key], (
                f"{name} {key}: mini {value}, upstream {want_samples[key]}"
            )


# --------------------------------------------------------------- generated steps


def generated_steps(seed: int, num_steps: int, num_spec: int | None) -> list:
    rng = random.Random(seed)
    bounds = TTFT_BUCKETS + TOKEN_LATENCY_BUCKETS + REQUEST_LATENCY_BUCKETS
    sizes = build_1_2_5_buckets(MAX_MODEL_LEN)

    def seconds() -> float:  # on a bound, beside one, 0, or past the last
        bound = rng.choice(bounds)
        return rng.choice([bound, bound * (1 + 1e-9), bound * (1 - 1e-9), 0.0, 1e4, rng.random()])

    def size() -> int:
        return rng.choice([rng.choice(sizes), rng.randint(0, 2 * MAX_MODEL_LEN)])

    steps = []
    for _ in range(num_steps):
        scheduler_stats = None
        if rng.random() < 0.8:
            spec = None
            if num_spec is not None and rng.random() < 0.7:
                spec = SpecDecodingStats.new(num_spec)
                for _ in range(rng.randint(1, 4)):
                    spec.observe_draft(num_spec, rng.randint(0, num_spec))
            scheduler_stats = SchedulerStats(
                num_running_reqs=rng.randint(0, 9),
                num_waiting_reqs=rng.randint(0, 9),
                num_skipped_waiting_reqs=rng.randint(0, 3),
                kv_cache_usage=rng.random(),
                prefix_cache_stats=PrefixCacheStats(
                    requests=rng.randint(0, 3), queries=size(), hits=size()
                ),
                spec_decoding_stats=spec,
            )
        iteration_stats = None
        if rng.random() < 0.8:
            iteration_stats = IterationStats()
            iteration_stats.num_generation_tokens = size()
            local, external = rng.randint(0, 20), rng.randint(0, 20)
            computed = rng.randint(0, 40)
            iteration_stats.prompt_token_stats = PromptTokenStats(
                computed=computed,
                local_cache_hit=local,
                external_kv_transfer=external,
                cached_tokens=local + external,
                total=computed + local + external,
            )
            iteration_stats.num_preempted_reqs = rng.randint(0, 2)
            iteration_stats.time_to_first_tokens_iter = [
                seconds() for _ in range(rng.randint(0, 3))
            ]
            iteration_stats.inter_token_latencies_iter = [
                seconds() for _ in range(rng.randint(0, 5))
            ]
            for _ in range(rng.randint(0, 3)):
                iteration_stats.max_num_generation_tokens_iter.append(size())
                iteration_stats.n_params_iter.append(rng.choice([1, 2, 3, 5, 20, 21]))
                iteration_stats.finished_requests.append(
                    FinishedRequestStats(
                        finish_reason=rng.choice(list(FinishReason)),
                        request_id="r",
                        e2e_latency=seconds(),
                        num_prompt_tokens=size(),
                        num_generation_tokens=size(),
                        max_tokens_param=rng.choice([None, 0, size()]),
                        queued_time=seconds(),
                        prefill_time=seconds(),
                        inference_time=seconds(),
                        decode_time=seconds(),
                        mean_time_per_output_token=seconds(),
                        num_cached_tokens=rng.choice([-1, 0, size()]),
                    )
                )
        steps.append((scheduler_stats, iteration_stats))
    return steps


@pytest.mark.parametrize("num_spec", [None, 3])
@pytest.mark.parametrize("seed", range(3))
def test_generated_steps_expose_as_upstream(seed, num_spec):
    compare(generated_steps(seed, 60, num_spec), MAX_MODEL_LEN, num_spec)


# --------------------------------------------------------------- a real run


@pytest.fixture(scope="module")
def recorded_run():
    """Each step's stats as the engine's logger got them, and its exposition."""
    engine = AsyncLLM.from_model(
        tiny_text_model(),
        model_name=MODEL,
        num_gpu_blocks_override=12,
        block_size=4,
        max_num_seqs=8,
        max_model_len=MAX_MODEL_LEN,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 2,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 2,
        },
    )
    steps = []
    record = engine.stat_logger.record

    def recording(scheduler_stats, iteration_stats):
        steps.append((copy.deepcopy(scheduler_stats), copy.deepcopy(iteration_stats)))
        record(scheduler_stats, iteration_stats)

    engine.stat_logger.record = recording
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prefix = [100, 101, 102, 103] * 5  # 5 full blocks, shared

    async def one(i):
        outputs = [
            out async for out in engine.generate([*prefix, 200 + i, 100, 101], params, f"r{i}")
        ]
        return outputs[-1]

    async def main():
        try:
            return await asyncio.gather(*(one(i) for i in range(6)))
        finally:
            engine.shutdown()

    asyncio.run(main())
    return engine, steps


def test_a_real_run_exposes_as_upstream(recorded_run):
    engine, steps = recorded_run
    preempted = sum(it.num_preempted_reqs for _, it in steps if it is not None)
    hits = sum(st.prefix_cache_stats.hits for st, _ in steps if st is not None)
    assert preempted and hits, f"the run must preempt ({preempted}) and hit the cache ({hits})"
    compare(steps, MAX_MODEL_LEN, 2)
    # The recording is what the engine's own logger got: same exposition.
    replayed = PrometheusStatLogger(engine.vllm_config, MODEL)
    for step in steps:
        replayed.record(*step)
    assert oracle.exposition(replayed.render().decode()) == oracle.exposition(
        engine.stat_logger.render().decode()
    )


# --------------------------------------------------------------- the stats themselves


def test_iteration_stats_follow_upstreams():
    """The same outputs (tokens, events, prefill stats, timestamps) through
    mini_vllm's IterationStats and upstream's: every step's counts, latencies
    and finished-request intervals, and every request's timestamps, agree."""
    from vllm.v1.engine import EngineCoreEvent as UpEvent
    from vllm.v1.engine import EngineCoreEventType as UpEventType
    from vllm.v1.engine import EngineCoreOutput as UpOutput
    from vllm.v1.engine import FinishReason as UpFinishReason
    from vllm.v1.metrics import stats as up

    from mini_vllm.engine import EngineCoreEvent, EngineCoreEventType, EngineCoreOutput
    from mini_vllm.metrics.stats import PrefillStats, RequestStateStats

    rng = random.Random(0)
    lora_states = up.LoRARequestStates(log_stats=False)
    for _ in range(30):  # workloads
        live = {}  # id -> [mini RequestStateStats, upstream's, prefilling, prompt length]
        clock, wall, next_id = 100.0, 1000.0, 0
        for _ in range(rng.randint(1, 12)):  # steps
            clock += rng.choice([0.0, 0.004, 0.3, 2.5])
            wall += rng.choice([0.0, 0.004, 0.3, 2.5])
            for _ in range(rng.randint(0, 2)):  # arrivals
                arrival = wall - rng.random()
                live[f"r{next_id}"] = [
                    RequestStateStats(arrival_time=arrival),
                    up.RequestStateStats(arrival_time=arrival),
                    True,
                    rng.randint(1, 40),
                ]
                next_id += 1
            mini_it, up_it = IterationStats(), up.IterationStats()
            mini_it.iteration_timestamp = up_it.iteration_timestamp = wall
            for req_id in list(live):
                if rng.random() < 0.3:
                    continue  # no output for it this step
                mini_stats, up_stats, prefilling, prompt_len = live[req_id]
                events = [
                    (rng.choice(list(EngineCoreEventType)), clock - rng.random())
                    for _ in range(rng.randint(0, 3))
                ]
                tokens = [7] * rng.randint(0 if not prefilling else 1, 3)
                finish = rng.choice([None, None, *FinishReason])
                local = rng.randint(0, prompt_len)
                external = rng.randint(0, prompt_len - local)
                prefill = None
                if prefilling and rng.random() < 0.9:
                    prefill = PrefillStats()
                    prefill.set(prompt_len, local, external)
                up_prefill = None
                if prefill is not None:
                    up_prefill = up.PrefillStats()
                    up_prefill.set(prompt_len, local, external)
                mini_out = EngineCoreOutput(
                    req_id,
                    tokens,
                    events=[EngineCoreEvent(t, ts) for t, ts in events] or None,
                    prefill_stats=prefill,
                )
                up_out = UpOutput(
                    req_id,
                    tokens,
                    events=[UpEvent(UpEventType(int(t)), ts) for t, ts in events] or None,
                    prefill_stats=up_prefill,
                )
                mini_it.update_from_output(mini_out, clock, prefilling, mini_stats)
                up_it.update_from_output(up_out, clock, prefilling, up_stats, lora_states, None)
                live[req_id][2] = False
                if finish is not None:
                    cached = rng.randint(-1, prompt_len)
                    args = (req_id, prompt_len, rng.choice([None, 16]))
                    mini_it.update_from_finished_request(finish, *args, mini_stats, cached)
                    up_it.update_from_finished_request(
                        UpFinishReason(int(finish)), *args, up_stats, cached
                    )
                    del live[req_id]
                mini_fields = {k: v for k, v in vars(mini_stats).items()}
                up_fields = {k: v for k, v in vars(up_stats).items() if k != "is_corrupted"}
                assert mini_fields == up_fields, f"{req_id}: request timestamps differ"
            # mini_vllm's, converted field by field (no corrupted-request count: left out)
            got = vars(oracle.to_upstream(None, mini_it)[1])
            want = vars(up_it)
            assert set(vars(mini_it)) <= set(want), "mini_vllm has fields upstream has not"
            for name, value in want.items():
                assert got[name] == value, (
                    f"IterationStats.{name}: mini {got[name]}, upstream {value}"
                )
