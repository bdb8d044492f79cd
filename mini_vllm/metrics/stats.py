"""The engine's statistics: per step (scheduler, iteration) and per request.

Mirrors upstream ``vllm/v1/metrics/stats.py`` at v0.22.1:
``PrefixCacheStats`` (:115), ``SchedulerStats`` (:171), ``RequestStateStats``
(:202), ``FinishedRequestStats`` (:224), ``PrefillStats`` (:243),
``PromptTokenStats`` (:277) and ``IterationStats`` (:325); its spec-decode
stats are ``mini_vllm.spec_decode.metrics.SpecDecodingStats``.

Who fills what, as upstream: the scheduler makes a ``SchedulerStats`` each
step and records a request's events (QUEUED, SCHEDULED, PREEMPTED) and its
``PrefillStats``; the front end's output processor turns each step's outputs
into an ``IterationStats`` (tokens, TTFT, inter-token latencies, finished
requests' intervals); ``mini_vllm.metrics.loggers.PrometheusStatLogger``
records both. Timestamps: ``arrival_time`` and ``iteration_timestamp`` are
wall-clock (``time.time()``), the engine core's are ``time.monotonic()``.

Left out: the multimodal and connector cache stats, KV-eviction events,
LoRA states, CUDA-graph and MFU stats, NaN (corrupted-request) tracking, and
the interval logger's ``CachingMetrics``. Phase 09's step-clock request
timing (with priorities) is ``mini_vllm.metrics.fairness``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mini_vllm.spec_decode.metrics import SpecDecodingStats

if TYPE_CHECKING:
    from mini_vllm.engine import EngineCoreEvent, EngineCoreOutput, FinishReason


@dataclass
class PrefixCacheStats:
    """Token counts of prefix-cache lookups; preempted requests counted apart
    (their re-admission hits their own freed blocks and would flatter the rate)."""

    reset: bool = False  # reset_prefix_cache ran before these lookups
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0  # the waiting queue
    num_skipped_waiting_reqs: int = 0  # the blocked one (grammar, remote KV)
    kv_cache_usage: float = 0.0
    prefix_cache_stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    # This step's drafts and acceptances; None when no draft was verified.
    spec_decoding_stats: SpecDecodingStats | None = None


@dataclass
class RequestStateStats:
    """A live request's timestamps, kept by the front end across steps."""

    num_generation_tokens: int = 0
    arrival_time: float = 0.0  # wall-clock, set by the front end
    queued_ts: float = 0.0  # the rest: engine core, monotonic
    scheduled_ts: float = 0.0  # 0.0: not scheduled yet
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0
    first_token_latency: float = 0.0


@dataclass
class FinishedRequestStats:
    """A finished request's sizes and intervals (seconds)."""

    finish_reason: FinishReason
    request_id: str | None = None
    e2e_latency: float = 0.0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    max_tokens_param: int | None = None
    queued_time: float = 0.0
    prefill_time: float = 0.0
    inference_time: float = 0.0
    decode_time: float = 0.0
    mean_time_per_output_token: float = 0.0
    num_cached_tokens: int = 0


@dataclass
class PrefillStats:
    """A request's first scheduled prefill: its prompt tokens by where they came from."""

    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0  # computed by the model
    num_cached_tokens: int = 0  # local + external
    num_local_cached_tokens: int = 0  # the prefix cache
    num_external_cached_tokens: int = 0  # a KV connector

    def set(
        self, num_prompt_tokens: int, num_local_cached_tokens: int, num_external_cached_tokens: int
    ) -> None:
        num_cached_tokens = num_local_cached_tokens + num_external_cached_tokens
        assert num_cached_tokens <= num_prompt_tokens
        self.num_prompt_tokens = num_prompt_tokens
        self.num_computed_tokens = num_prompt_tokens - num_cached_tokens
        self.num_cached_tokens = num_cached_tokens
        self.num_local_cached_tokens = num_local_cached_tokens
        self.num_external_cached_tokens = num_external_cached_tokens


@dataclass
class PromptTokenStats:
    """One step's prompt tokens by source; computed + local + external = total."""

    ALL_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")

    computed: int = 0
    local_cache_hit: int = 0
    external_kv_transfer: int = 0
    cached_tokens: int = 0
    total: int = 0

    def update_from_output(self, prefill_stats: PrefillStats) -> None:
        self.computed += prefill_stats.num_computed_tokens
        self.cached_tokens += prefill_stats.num_cached_tokens
        self.total += prefill_stats.num_prompt_tokens
        self.local_cache_hit += prefill_stats.num_local_cached_tokens
        self.external_kv_transfer += prefill_stats.num_external_cached_tokens

    def get_by_source(self, source: str) -> int:
        counts = {
            "local_compute": self.computed,
            "local_cache_hit": self.local_cache_hit,
            "external_kv_transfer": self.external_kv_transfer,
        }
        if source not in counts:
            raise ValueError(f"Unknown source: {source}")
        return counts[source]


class IterationStats:
    """What one step's outputs did, as the front end saw them."""

    def __init__(self) -> None:
        self.iteration_timestamp = time.time()
        self.num_generation_tokens = 0
        self.prompt_token_stats = PromptTokenStats()
        self.num_preempted_reqs = 0
        self.finished_requests: list[FinishedRequestStats] = []
        self.max_num_generation_tokens_iter: list[int] = []
        self.n_params_iter: list[int] = []
        self.time_to_first_tokens_iter: list[float] = []
        self.inter_token_latencies_iter: list[float] = []

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={value}" for name, value in vars(self).items())
        return f"IterationStats({fields})"

    @property
    def num_prompt_tokens(self) -> int:
        return self.prompt_token_stats.total

    def _time_since(self, start: float) -> float:
        return self.iteration_timestamp - start

    # BEGIN LAB 18.3: one request's output in a step
    def update_from_output(
        self,
        output: EngineCoreOutput,
        engine_core_timestamp: float,
        is_prefilling: bool,
        req_stats: RequestStateStats,
    ) -> None:
        """One request's output this step. ``is_prefilling``: this is its
        first output (its prompt is done), so it gives TTFT; a later one gives
        an inter-token latency (time since its previous output)."""
        # HINT: upstream: vllm/v1/metrics/stats.py:353. Times since arrival use
        # HINT: self._time_since (wall clock); token timestamps are engine_core_timestamp.
        # HINT: events are applied after the token counts, before the token timestamps.
        num_new = len(output.new_token_ids)
        self.num_generation_tokens += num_new
        if is_prefilling:
            if output.prefill_stats is not None:
                self.prompt_token_stats.update_from_output(output.prefill_stats)
            ttft = self._time_since(req_stats.arrival_time)
            self.time_to_first_tokens_iter.append(ttft)
            req_stats.first_token_latency = ttft
        req_stats.num_generation_tokens += num_new

        if output.events is not None:
            self.update_from_events(output.events, req_stats)

        if is_prefilling:
            req_stats.first_token_ts = engine_core_timestamp
        else:
            self.inter_token_latencies_iter.append(engine_core_timestamp - req_stats.last_token_ts)
        req_stats.last_token_ts = engine_core_timestamp

    # END LAB 18.3

    # BEGIN LAB 18.3: the engine core's events
    def update_from_events(
        self, events: list[EngineCoreEvent], req_stats: RequestStateStats
    ) -> None:
        """QUEUED and the first SCHEDULED set the request's timestamps (a
        re-admission after a preemption does not move ``scheduled_ts``);
        each PREEMPTED counts one preemption."""
        # HINT: upstream: stats.py:404. EngineCoreEventType is imported inside the function
        # HINT: (mini_vllm.engine imports this module).
        from mini_vllm.engine import EngineCoreEventType

        for event in events:
            if event.type == EngineCoreEventType.QUEUED:
                req_stats.queued_ts = event.timestamp
            elif event.type == EngineCoreEventType.SCHEDULED:
                if req_stats.scheduled_ts == 0.0:
                    req_stats.scheduled_ts = event.timestamp
            elif event.type == EngineCoreEventType.PREEMPTED:
                self.num_preempted_reqs += 1

    # END LAB 18.3

    # BEGIN LAB 18.3: a finished request's intervals
    def update_from_finished_request(
        self,
        finish_reason: FinishReason,
        request_id: str,
        num_prompt_tokens: int,
        max_tokens_param: int | None,
        req_stats: RequestStateStats,
        num_cached_tokens: int = 0,
    ) -> None:
        """The request's intervals: queued = first SCHEDULED - QUEUED; prefill
        = first token - first SCHEDULED; decode = last token - first token;
        inference = last token - first SCHEDULED (preemptions stay inside the
        interval they fall in); e2e = now - arrival; TPOT = decode time per
        token after the first (0 for one token)."""
        # HINT: upstream: stats.py:428. Append one FinishedRequestStats.
        decode_time = req_stats.last_token_ts - req_stats.first_token_ts
        num_after_first = req_stats.num_generation_tokens - 1
        self.finished_requests.append(
            FinishedRequestStats(
                finish_reason=finish_reason,
                request_id=request_id,
                e2e_latency=self._time_since(req_stats.arrival_time),
                num_prompt_tokens=num_prompt_tokens,
                num_generation_tokens=req_stats.num_generation_tokens,
                max_tokens_param=max_tokens_param,
                queued_time=req_stats.scheduled_ts - req_stats.queued_ts,
                prefill_time=req_stats.first_token_ts - req_stats.scheduled_ts,
                inference_time=req_stats.last_token_ts - req_stats.scheduled_ts,
                decode_time=decode_time,
                mean_time_per_output_token=decode_time / num_after_first
                if num_after_first > 0
                else 0,
                num_cached_tokens=num_cached_tokens,
            )
        )

    # END LAB 18.3
