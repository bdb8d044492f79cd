"""Engine statistics as Prometheus metrics, under upstream's names.

Mirrors upstream ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger`` :404;
the metrics it defines from :451 on, ``record`` :1058) at v0.22.1, for what
mini_vllm measures: requests running and waiting, KV-cache usage, prefix-cache
queries and hits, prompt and generation tokens, finished requests by reason.
Labels ``model_name`` and ``engine`` as upstream (one engine: "0").

Each ``PrometheusStatLogger`` has its own registry (upstream uses the global
one), so that several servers in one process (the tests) keep apart.
Left out: histograms (latencies, request sizes), spec-decode, KV-connector,
LoRA and multimodal metrics, the logging stat logger.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from mini_vllm.metrics.stats import SchedulerStats


class PrometheusStatLogger:
    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name, "engine": "0"}

        def gauge(name: str, doc: str):
            return Gauge(name, doc, list(labels), registry=self.registry).labels(**labels)

        def counter(name: str, doc: str):
            return Counter(name, doc, list(labels), registry=self.registry).labels(**labels)

        self.gauge_scheduler_running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.gauge_scheduler_waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.gauge_kv_cache_usage = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.counter_prefix_cache_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.counter_prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.counter_prompt_tokens = counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed."
        )
        self.counter_generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self.counter_request_success = {
            reason: request_success.labels(**labels, finished_reason=reason)
            for reason in ("stop", "length", "abort", "error", "repetition")
        }

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        num_prompt_tokens: int = 0,
        num_generation_tokens: int = 0,
        finished_reasons: tuple[str, ...] = (),
    ) -> None:
        """One step: the scheduler's state and this step's token and request counts."""
        if scheduler_stats is not None:
            self.gauge_scheduler_running.set(scheduler_stats.num_running_reqs)
            self.gauge_scheduler_waiting.set(scheduler_stats.num_waiting_reqs)
            self.gauge_kv_cache_usage.set(scheduler_stats.kv_cache_usage)
            self.counter_prefix_cache_queries.inc(scheduler_stats.prefix_cache_stats.queries)
            self.counter_prefix_cache_hits.inc(scheduler_stats.prefix_cache_stats.hits)
        self.counter_prompt_tokens.inc(num_prompt_tokens)
        self.counter_generation_tokens.inc(num_generation_tokens)
        for reason in finished_reasons:
            self.counter_request_success[reason].inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
