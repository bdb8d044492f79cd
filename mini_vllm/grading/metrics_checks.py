"""The harness Lab 18.3 grades the metrics with, against upstream on a CPU.

The reference's own tests (tests/upstream/test_metrics_prometheus.py) and the
graded suite under phases/18-performance/ share it. Two checks:

- ``stats_follow_upstream``: generated workloads (arrivals, outputs, engine-core
  events, prefill stats, finishes, on a wall clock and a monotonic one) go
  through an ``IterationStats`` class and upstream's (vllm/v1/metrics/stats.py:325);
  every request's ``RequestStateStats`` and every step's fields must agree.
- ``expositions_agree``: steps' ``(SchedulerStats, IterationStats)`` go to a
  ``PrometheusStatLogger`` and to upstream's (vllm/v1/metrics/loggers.py:404),
  built on this CPU by ``mini_vllm.oracle.prometheus``; their expositions must
  agree family by family (type, help text) and sample by sample.
  ``generated_steps`` makes such steps, with values on and beside the bucket
  bounds, every finish reason and drafts at every position.

Both take ``call``: how to call the code under grade (the graded suite passes
``written``, so an unwritten lab region fails at once). Failures name the
workload, the step and the field, with "yours" and upstream's values.
"""

from __future__ import annotations

import copy
import random

from mini_vllm.config import ModelConfig, SpeculativeConfig, VllmConfig
from mini_vllm.engine import EngineCoreEvent, EngineCoreEventType, EngineCoreOutput, FinishReason
from mini_vllm.metrics.loggers import (
    REQUEST_LATENCY_BUCKETS,
    TOKEN_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    build_1_2_5_buckets,
)
from mini_vllm.metrics.stats import (
    FinishedRequestStats,
    IterationStats,
    PrefillStats,
    PrefixCacheStats,
    PromptTokenStats,
    RequestStateStats,
    SchedulerStats,
)
from mini_vllm.oracle import prometheus as oracle
from mini_vllm.spec_decode.metrics import SpecDecodingStats

MODEL = "tiny"
MAX_MODEL_LEN = 44


def _plain(fn, *args):
    return fn(*args)


# ------------------------------------------------------------------ the stats


def stats_follow_upstream(
    iteration_stats_cls,
    seed: int,
    num_workloads: int,
    events: bool = True,
    finishes: bool = True,
    call=_plain,
) -> None:
    """Generated outputs through ``iteration_stats_cls`` and upstream's
    IterationStats, step by step; ``events`` and ``finishes`` switch on the
    engine-core events and the finished requests."""
    from vllm.v1.engine import EngineCoreEvent as UpEvent
    from vllm.v1.engine import EngineCoreEventType as UpEventType
    from vllm.v1.engine import EngineCoreOutput as UpOutput
    from vllm.v1.engine import FinishReason as UpFinishReason
    from vllm.v1.metrics import stats as up

    rng = random.Random(seed)
    lora_states = up.LoRARequestStates(log_stats=False)
    for workload in range(num_workloads):
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
            mine, theirs = iteration_stats_cls(), up.IterationStats()
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
                call(mine.update_from_output, out, clock, prefilling, my_req)
                theirs.update_from_output(up_out, clock, prefilling, up_req, lora_states, None)
                live[req_id][2] = False
                named = [(t.name, ts) for t, ts in evs]
                what = f"{where}, {req_id}'s output {tokens}, events {named}"
                finish = rng.choice([None, None, *FinishReason]) if finishes else None
                if finish is not None:
                    cached = rng.randint(-1, prompt_len)
                    args = (req_id, prompt_len, rng.choice([None, 16]))
                    call(mine.update_from_finished_request, finish, *args, my_req, cached)
                    theirs.update_from_finished_request(
                        UpFinishReason(int(finish)), *args, up_req, cached
                    )
                    what += f", finished ({finish.name})"
                    del live[req_id]
                got = vars(my_req)  # upstream's corrupted-request flag is left out
                want = {k: v for k, v in vars(up_req).items() if k != "is_corrupted"}
                assert got == want, (
                    f"{what}: the request's RequestStateStats differ\n"
                    f"  yours:    {got}\n  upstream: {want}"
                )
            extra = sorted(set(vars(mine)) - set(vars(theirs)))
            assert not extra, f"{where}: IterationStats has fields upstream has not: {extra}"
            got = vars(oracle.to_upstream(None, mine)[1])
            for name, value in vars(theirs).items():
                assert got[name] == value, (
                    f"{where}: IterationStats.{name}\n  yours:    {got[name]}\n  upstream: {value}"
                )


# ------------------------------------------------------------------ the logger


def generated_steps(seed: int, num_steps: int, num_spec: int | None) -> list:
    """Steps' (SchedulerStats | None, IterationStats | None): values on and
    beside the bucket bounds, every finish reason, drafts at every position."""
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


def logger_config(num_spec: int | None, max_model_len: int = MAX_MODEL_LEN) -> VllmConfig:
    """mini_vllm's config for a logger (speculation on when ``num_spec``)."""
    speculative = None if num_spec is None else SpeculativeConfig(num_speculative_tokens=num_spec)
    return VllmConfig(
        model_config=ModelConfig(max_model_len=max_model_len), speculative_config=speculative
    )


def same_exposition(mine, where: str) -> None:
    """``mine``'s exposition against upstream's logger's (in the global
    registry): the same families, types, help texts and samples, except the
    families mini_vllm leaves out on purpose (``oracle.LEFT_OUT``)."""
    got = oracle.exposition(mine.render().decode())
    want = oracle.upstream_exposition()
    missing = sorted(set(want) - set(got) - set(oracle.LEFT_OUT))
    assert not missing, f"{where}: upstream has these metrics and yours has not: {missing}"
    extra = sorted(set(got) - set(want))
    assert not extra, f"{where}: yours has metrics upstream has not: {extra}"
    for name, (kind, doc, samples) in got.items():
        want_kind, want_doc, want_samples = want[name]
        assert (kind, doc) == (want_kind, want_doc), f"{where}: {name}: type or help text differs"
        for sample in samples.keys() | want_samples.keys():
            value, want_value = samples.get(sample), want_samples.get(sample)
            assert value == want_value, (
                f"{where}: {name} {sample}: yours {value}, upstream {want_value}"
            )


def expositions_agree(mine, steps, num_spec: int | None, call=_plain, each_step=True) -> None:
    """Feed ``steps`` to the logger ``mine`` and to upstream's, and compare
    their expositions after every step (or only after the last). Upstream's is
    built after ``mine``'s first record, so an unwritten one fails at once."""
    upstream = None
    for step, (scheduler_stats, iteration_stats) in enumerate(steps):
        call(mine.record, copy.deepcopy(scheduler_stats), copy.deepcopy(iteration_stats))
        if upstream is None:
            upstream = oracle.upstream_logger(MAX_MODEL_LEN, MODEL, num_spec)
        upstream.record(*oracle.to_upstream(scheduler_stats, iteration_stats))
        if each_step or step == len(steps) - 1:
            same_exposition(mine, f"after step {step} ({iteration_stats!r})")
