"""Lab 18.3 — metrics from stats: IterationStats and the Prometheus logger.

Graded: the ``LAB 18.3`` regions of ``labs/phase_18/stats.py`` and
``labs/phase_18/loggers.py``.

Against upstream, live on this CPU (the harness of
tests/upstream/test_metrics_prometheus.py):

1. the stats: the same generated outputs (tokens, engine-core events,
   prefill stats, timestamps, finishes) go through your ``IterationStats``
   and upstream's (vllm/v1/metrics/stats.py:325); every step's fields and
   every request's timestamps must agree;
2. the logger: the same generated steps' stats go to your
   ``PrometheusStatLogger.record`` and upstream's (vllm/v1/metrics/loggers.py:1058);
   the two expositions must agree sample by sample (counters, gauges,
   histogram buckets, counts and sums).
"""

from __future__ import annotations

import copy
import random

import pytest

from mini_vllm.config import ModelConfig, SpeculativeConfig, VllmConfig
from mini_vllm.engine import EngineCoreEvent, EngineCoreEventType, EngineCoreOutput, FinishReason
from mini_vllm.grading.checks import written
from mini_vllm.metrics.loggers import (
    REQUEST_LATENCY_BUCKETS,
    TOKEN_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    build_1_2_5_buckets,
)
from mini_vllm.metrics.stats import (
    FinishedRequestStats,
    PrefillStats,
    PrefixCacheStats,
    PromptTokenStats,
    RequestStateStats,
    SchedulerStats,
)
from mini_vllm.spec_decode.metrics import SpecDecodingStats

pytestmark = [pytest.mark.upstream, pytest.mark.timeout(60)]

MODEL = "tiny"
MAX_MODEL_LEN = 44


@pytest.fixture(scope="module")
def oracle():
    return pytest.importorskip("mini_vllm.oracle.prometheus")


# ------------------------------------------------------------------ the stats


def run_stats(impl, oracle, seed: int, events: bool, finishes: bool) -> None:
    """Generated workloads through your IterationStats and upstream's, step by step."""
    from vllm.v1.engine import EngineCoreEvent as UpEvent
    from vllm.v1.engine import EngineCoreEventType as UpEventType
    from vllm.v1.engine import EngineCoreOutput as UpOutput
    from vllm.v1.engine import FinishReason as UpFinishReason
    from vllm.v1.metrics import stats as up

    rng = random.Random(seed)
    lora_states = up.LoRARequestStates(log_stats=False)
    for workload in range(20):
        live = {}  # id -> [your RequestStateStats, upstream's, prefilling, prompt length]
        clock, wall, next_id = 100.0, 1000.0, 0
        for step in range(rng.randint(1, 12)):
            clock += rng.choice([0.0, 0.004, 0.3, 2.5])  # the engine core's monotonic clock
            wall += rng.choice([0.0, 0.004, 0.3, 2.5])  # the front end's wall clock
            for _ in range(rng.randint(0, 2)):
                arrival = wall - rng.random()
                live[f"r{next_id}"] = [
                    RequestStateStats(arrival_time=arrival),
                    up.RequestStateStats(arrival_time=arrival),
                    True,
                    rng.randint(1, 40),
                ]
                next_id += 1
            mine, theirs = impl.stats.IterationStats(), up.IterationStats()
            mine.iteration_timestamp = theirs.iteration_timestamp = wall
            where = f"workload {workload}, step {step}"
            for req_id in list(live):
                if rng.random() < 0.3:
                    continue  # no output for it this step
                my_req, up_req, prefilling, prompt_len = live[req_id]
                evs = []
                if events:
                    evs = [
                        (rng.choice(list(EngineCoreEventType)), clock - rng.random())
                        for _ in range(rng.randint(0, 3))
                    ]
                tokens = [7] * rng.randint(1 if prefilling else 0, 3)
                local = rng.randint(0, prompt_len)
                external = rng.randint(0, prompt_len - local)
                prefill = up_prefill = None
                if prefilling and rng.random() < 0.9:
                    prefill, up_prefill = PrefillStats(), up.PrefillStats()
                    prefill.set(prompt_len, local, external)
                    up_prefill.set(prompt_len, local, external)
                out = EngineCoreOutput(
                    req_id,
                    tokens,
                    events=[EngineCoreEvent(t, ts) for t, ts in evs] or None,
                    prefill_stats=prefill,
                )
                up_out = UpOutput(
                    req_id,
                    tokens,
                    events=[UpEvent(UpEventType(int(t)), ts) for t, ts in evs] or None,
                    prefill_stats=up_prefill,
                )
                written(mine.update_from_output, out, clock, prefilling, my_req)
                theirs.update_from_output(up_out, clock, prefilling, up_req, lora_states, None)
                live[req_id][2] = False
                named = [(t.name, ts) for t, ts in evs]
                what = f"{where}, {req_id}'s output {tokens}, events {named}"
                finish = rng.choice([None, None, *FinishReason]) if finishes else None
                if finish is not None:
                    cached = rng.randint(-1, prompt_len)
                    args = (req_id, prompt_len, rng.choice([None, 16]))
                    written(mine.update_from_finished_request, finish, *args, my_req, cached)
                    theirs.update_from_finished_request(
                        UpFinishReason(int(finish)), *args, up_req, cached
                    )
                    what += f", finished ({finish.name})"
                    del live[req_id]
                got = vars(my_req)
                want = {k: v for k, v in vars(up_req).items() if k != "is_corrupted"}
                assert got == want, (
                    f"{what}: the request's RequestStateStats differ\n"
                    f"  yours:    {got}\n  upstream: {want}"
                )
            got = vars(oracle.to_upstream(None, mine)[1])
            for name, value in vars(theirs).items():
                assert got[name] == value, (
                    f"{where}: IterationStats.{name}\n  yours:    {got[name]}\n  upstream: {value}"
                )


@pytest.mark.points(3)
def test_tokens_ttft_and_inter_token_latencies(impl, oracle):
    """update_from_output alone: no events, nobody finishes."""
    run_stats(impl, oracle, seed=0, events=False, finishes=False)


@pytest.mark.points(3)
def test_events_set_queued_scheduled_and_count_preemptions(impl, oracle):
    """update_from_events: QUEUED, the first SCHEDULED only, each PREEMPTED."""
    run_stats(impl, oracle, seed=1, events=True, finishes=False)


@pytest.mark.points(4)
def test_a_finished_requests_intervals(impl, oracle):
    """update_from_finished_request: e2e, queued, prefill, decode, inference, TPOT."""
    run_stats(impl, oracle, seed=2, events=True, finishes=True)


# ------------------------------------------------------------------ the logger


def generated_steps(seed: int, num_steps: int, num_spec: int | None) -> list:
    """Steps' (SchedulerStats, IterationStats): values on and beside the
    bucket bounds, every finish reason, drafts at every position."""
    rng = random.Random(seed)
    bounds = TTFT_BUCKETS + TOKEN_LATENCY_BUCKETS + REQUEST_LATENCY_BUCKETS
    sizes = build_1_2_5_buckets(MAX_MODEL_LEN)

    def seconds() -> float:
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
            from mini_vllm.metrics.stats import IterationStats

            iteration_stats = IterationStats()
            iteration_stats.num_generation_tokens = size()
            local, external, computed = rng.randint(0, 20), rng.randint(0, 20), rng.randint(0, 40)
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


def compare_expositions(impl, oracle, steps, num_spec: int | None) -> None:
    speculative = None if num_spec is None else SpeculativeConfig(num_speculative_tokens=num_spec)
    config = VllmConfig(
        model_config=ModelConfig(max_model_len=MAX_MODEL_LEN), speculative_config=speculative
    )
    mine = impl.loggers.PrometheusStatLogger(config, MODEL)
    upstream = None
    for step, (scheduler_stats, iteration_stats) in enumerate(steps):
        written(mine.record, copy.deepcopy(scheduler_stats), copy.deepcopy(iteration_stats))
        if upstream is None:  # built after your first record: an unwritten one fails at once
            upstream = oracle.upstream_logger(MAX_MODEL_LEN, MODEL, num_spec)
        upstream.record(*oracle.to_upstream(scheduler_stats, iteration_stats))
        got = oracle.exposition(mine.render().decode())
        want = oracle.upstream_exposition()
        for name, (_, _, samples) in got.items():
            want_samples = want[name][2]
            for sample, value in samples.items():
                assert value == want_samples.get(sample), (
                    f"after step {step} ({iteration_stats!r}): {name} {sample}: "
                    f"yours {value}, upstream {want_samples.get(sample)}"
                )


@pytest.mark.points(4)
@pytest.mark.parametrize("seed", range(2))
def test_the_logger_exposes_as_upstream(impl, oracle, seed):
    compare_expositions(impl, oracle, generated_steps(seed, 30, None), None)


@pytest.mark.points(2)
def test_the_logger_with_speculation(impl, oracle):
    compare_expositions(impl, oracle, generated_steps(7, 30, 3), 3)
