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

The harness (the generated steps and workloads, the two checks) is
mini_vllm/grading/metrics_checks.py, which Lab 18.3's graded suite shares.
"""

from __future__ import annotations

import asyncio
import copy

import pytest
from serve_helpers import tiny_text_model

from mini_vllm.engine.async_llm import AsyncLLM
from mini_vllm.metrics.loggers import PrometheusStatLogger
from mini_vllm.metrics.stats import IterationStats
from mini_vllm.sampling_params import SamplingParams

pytestmark = pytest.mark.upstream

checks = pytest.importorskip("mini_vllm.grading.metrics_checks")
oracle = checks.oracle

MODEL = checks.MODEL
MAX_MODEL_LEN = checks.MAX_MODEL_LEN


def compare(steps, num_spec: int | None) -> None:
    """Feed ``steps`` [(SchedulerStats | None, IterationStats | None)] to a
    fresh mini_vllm logger and upstream's; compare after the last step."""
    mini = PrometheusStatLogger(checks.logger_config(num_spec), MODEL)
    checks.expositions_agree(mini, steps, num_spec, each_step=False)


# --------------------------------------------------------------- generated steps


@pytest.mark.parametrize("num_spec", [None, 3])
@pytest.mark.parametrize("seed", range(3))
def test_generated_steps_expose_as_upstream(seed, num_spec):
    compare(checks.generated_steps(seed, 60, num_spec), num_spec)


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
    compare(steps, 2)
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
    checks.stats_follow_upstream(IterationStats, seed=0, num_workloads=30)
