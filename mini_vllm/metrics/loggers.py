"""Engine statistics as Prometheus metrics, under upstream's names.

Mirrors upstream ``vllm/v1/metrics/loggers.py`` at v0.22.1:
``PrometheusStatLogger`` (:404; its metrics are defined from :451 on,
``record`` :1058), ``build_buckets`` (:1241) and ``build_1_2_5_buckets``
(:1259), and the spec-decode counters of ``SpecDecodingProm``
(vllm/v1/spec_decode/metrics.py:121). Same names, documentation, labels
(``model_name`` and ``engine``; one engine, "0"), buckets and values: fed the
same stats, upstream's exposition and this one agree sample by sample on
every metric both have (tests/upstream/test_metrics_prometheus.py checks it).

``record`` is the whole idea: one step's ``SchedulerStats`` sets the gauges
and adds to the prefix-cache and spec-decode counters; its
``IterationStats`` adds tokens and preemptions and observes the latency
histograms, one sample per first token (TTFT), per later output
(inter-token latency) and per finished request (e2e, queue, prefill,
decode, inference time, TPOT, sizes).

Differences: each logger has its own registry (upstream registers in the
global one and unregisters older vLLM metrics first), so that several
engines in one process (the tests) keep apart. Left out: the sleep-state,
multimodal-cache, external (connector) prefix-cache, KV-connector, MFU,
LoRA, corrupted-request and KV-residency metrics, ``cache_config_info``,
and the interval logger (``LoggingStatLogger``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from mini_vllm.engine import FinishReason
from mini_vllm.metrics.stats import IterationStats, PromptTokenStats, SchedulerStats

TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]  # fmt: skip
# Inter-token latency and time per output token.
TOKEN_LATENCY_BUCKETS = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
]  # fmt: skip
REQUEST_LATENCY_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
]  # fmt: skip
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


def build_buckets(mantissa_lst: list[int], max_value: int) -> list[int]:
    """Each mantissa times 1, 10, 100, ... in turn, while the value stays <= max_value."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in mantissa_lst:
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value``."""
    return build_buckets([1, 2, 5], max_value)


class PrometheusStatLogger:
    def __init__(self, vllm_config, model_name: str | None = None) -> None:
        """``model_name``: the ``model_name`` label (upstream: the served
        model name); defaults to the model's path."""
        self.registry = CollectorRegistry()
        model_name = model_name if model_name is not None else vllm_config.model_config.model
        labels = {"model_name": model_name or "", "engine": "0"}
        max_model_len = vllm_config.model_config.max_model_len

        def metric(cls, name: str, doc: str, **kwargs):
            return cls(name, doc, list(labels), registry=self.registry, **kwargs).labels(**labels)

        def by_label(cls, name: str, doc: str, label: str, values) -> dict:
            family = cls(name, doc, [*labels, label], registry=self.registry)
            return {value: family.labels(**labels, **{label: str(value)}) for value in values}

        # The scheduler's state.
        self.gauge_scheduler_running = metric(
            Gauge, "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.gauge_scheduler_waiting = metric(
            Gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.gauge_waiting_by_reason = by_label(
            Gauge,
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
            "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, "
            "KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
            "reason",
            ("capacity", "deferred"),
        )
        self.gauge_kv_cache_usage = metric(
            Gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )

        # Counters.
        self.counter_prefix_cache_queries = metric(
            Counter,
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.counter_prefix_cache_hits = metric(
            Counter,
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
        )
        self.counter_num_preempted_reqs = metric(
            Counter, "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.counter_prompt_tokens = metric(
            Counter, "vllm:prompt_tokens", "Number of prefill tokens processed."
        )
        self.counter_prompt_tokens_by_source = by_label(
            Counter,
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            "source",
            PromptTokenStats.ALL_SOURCES,
        )
        self.counter_prompt_tokens_cached = metric(
            Counter,
            "vllm:prompt_tokens_cached",
            "Number of cached prompt tokens (local + external).",
        )
        self.counter_generation_tokens = metric(
            Counter, "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self.counter_request_success = by_label(
            Counter,
            "vllm:request_success",
            "Count of successfully processed requests.",
            "finished_reason",
            FinishReason,
        )

        # Speculative decoding (only with a speculative config, as upstream).
        spec = vllm_config.speculative_config
        self.spec_decoding_enabled = spec is not None
        if self.spec_decoding_enabled:
            self.counter_spec_decode_num_drafts = metric(
                Counter, "vllm:spec_decode_num_drafts", "Number of spec decoding drafts."
            )
            self.counter_spec_decode_num_draft_tokens = metric(
                Counter, "vllm:spec_decode_num_draft_tokens", "Number of draft tokens."
            )
            self.counter_spec_decode_num_accepted_tokens = metric(
                Counter, "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."
            )
            per_pos = by_label(
                Counter,
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                "position",
                range(spec.num_speculative_tokens),
            )
            self.counter_spec_decode_num_accepted_tokens_per_pos = list(per_pos.values())

        # Histograms of sizes.
        sizes = build_1_2_5_buckets(max_model_len)
        self.histogram_num_prompt_tokens_request = metric(
            Histogram,
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            buckets=sizes,
        )
        self.histogram_num_generation_tokens_request = metric(
            Histogram,
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            buckets=sizes,
        )
        self.histogram_iteration_tokens = metric(
            Histogram,
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            buckets=ITERATION_TOKEN_BUCKETS,
        )
        self.histogram_max_num_generation_tokens_request = metric(
            Histogram,
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            buckets=sizes,
        )
        self.histogram_n_request = metric(
            Histogram,
            "vllm:request_params_n",
            "Histogram of the n request parameter.",
            buckets=[1, 2, 5, 10, 20],
        )
        self.histogram_max_tokens_request = metric(
            Histogram,
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            buckets=sizes,
        )

        # Histograms of latencies.
        self.histogram_time_to_first_token = metric(
            Histogram,
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            buckets=TTFT_BUCKETS,
        )
        self.histogram_inter_token_latency = metric(
            Histogram,
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            buckets=TOKEN_LATENCY_BUCKETS,
        )
        self.histogram_request_time_per_output_token = metric(
            Histogram,
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            buckets=TOKEN_LATENCY_BUCKETS,
        )

        def request_latency(name: str, doc: str):
            return metric(Histogram, name, doc, buckets=REQUEST_LATENCY_BUCKETS)

        self.histogram_e2e_time_request = request_latency(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."
        )
        self.histogram_queue_time_request = request_latency(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
        )
        self.histogram_inference_time_request = request_latency(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
        )
        self.histogram_prefill_time_request = request_latency(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
        )
        self.histogram_decode_time_request = request_latency(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
        )
        self.histogram_prefill_kv_computed_request = metric(
            Histogram,
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            buckets=sizes,
        )

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None:
        """One step's stats into the metrics (either may be None)."""
        if scheduler_stats is not None:
            self.gauge_scheduler_running.set(scheduler_stats.num_running_reqs)
            self.gauge_scheduler_waiting.set(
                scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
            )
            self.gauge_waiting_by_reason["capacity"].set(scheduler_stats.num_waiting_reqs)
            self.gauge_waiting_by_reason["deferred"].set(scheduler_stats.num_skipped_waiting_reqs)
            self.gauge_kv_cache_usage.set(scheduler_stats.kv_cache_usage)
            self.counter_prefix_cache_queries.inc(scheduler_stats.prefix_cache_stats.queries)
            self.counter_prefix_cache_hits.inc(scheduler_stats.prefix_cache_stats.hits)
            spec = scheduler_stats.spec_decoding_stats
            if spec is not None and self.spec_decoding_enabled:
                self.counter_spec_decode_num_drafts.inc(spec.num_drafts)
                self.counter_spec_decode_num_draft_tokens.inc(spec.num_draft_tokens)
                self.counter_spec_decode_num_accepted_tokens.inc(spec.num_accepted_tokens)
                for counter, n in zip(
                    self.counter_spec_decode_num_accepted_tokens_per_pos,
                    spec.num_accepted_tokens_per_pos,
                    strict=True,
                ):
                    counter.inc(n)

        if iteration_stats is None:
            return
        # BEGIN LAB 18.3: a step's iteration stats into the counters and histograms
        # HINT: receives iteration_stats (not None); leaves nothing defined. Upstream:
        # HINT: vllm/v1/metrics/loggers.py:1058, the part after the scheduler stats.
        # HINT: counters .inc(n), histograms .observe(x); one observation per list entry.
        # HINT: a finished request: its reason's success counter, then its intervals, sizes,
        # HINT: prefill tokens computed (a negative cached count means none), TPOT, max_tokens.
        self.counter_num_preempted_reqs.inc(iteration_stats.num_preempted_reqs)
        self.counter_prompt_tokens.inc(iteration_stats.num_prompt_tokens)
        prompt = iteration_stats.prompt_token_stats
        for source, counter in self.counter_prompt_tokens_by_source.items():
            counter.inc(prompt.get_by_source(source))
        self.counter_prompt_tokens_cached.inc(prompt.cached_tokens)
        self.counter_generation_tokens.inc(iteration_stats.num_generation_tokens)
        self.histogram_iteration_tokens.observe(
            iteration_stats.num_prompt_tokens + iteration_stats.num_generation_tokens
        )
        for max_gen_tokens in iteration_stats.max_num_generation_tokens_iter:
            self.histogram_max_num_generation_tokens_request.observe(max_gen_tokens)
        for n in iteration_stats.n_params_iter:
            self.histogram_n_request.observe(n)
        for ttft in iteration_stats.time_to_first_tokens_iter:
            self.histogram_time_to_first_token.observe(ttft)
        for itl in iteration_stats.inter_token_latencies_iter:
            self.histogram_inter_token_latency.observe(itl)

        for finished in iteration_stats.finished_requests:
            self.counter_request_success[finished.finish_reason].inc()
            self.histogram_e2e_time_request.observe(finished.e2e_latency)
            self.histogram_queue_time_request.observe(finished.queued_time)
            self.histogram_prefill_time_request.observe(finished.prefill_time)
            self.histogram_inference_time_request.observe(finished.inference_time)
            self.histogram_decode_time_request.observe(finished.decode_time)
            self.histogram_prefill_kv_computed_request.observe(
                finished.num_prompt_tokens - max(finished.num_cached_tokens, 0)
            )
            self.histogram_num_prompt_tokens_request.observe(finished.num_prompt_tokens)
            self.histogram_num_generation_tokens_request.observe(finished.num_generation_tokens)
            self.histogram_request_time_per_output_token.observe(
                finished.mean_time_per_output_token
            )
            if finished.max_tokens_param:
                self.histogram_max_tokens_request.observe(finished.max_tokens_param)
        # END LAB 18.3

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
