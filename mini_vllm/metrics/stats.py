"""Scheduler and prefix-cache statistics.

Mirrors upstream ``vllm/v1/metrics/stats.py`` at v0.22.1
(``PrefixCacheStats`` at :115, ``SchedulerStats`` at :171; its spec-decode
stats are ``mini_vllm.spec_decode.metrics.SpecDecodingStats``). Left out:
connector, CUDA-graph and MFU stats, Prometheus export.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mini_vllm.spec_decode.metrics import SpecDecodingStats


@dataclass
class PrefixCacheStats:
    """Token counts of prefix-cache lookups; preempted requests counted apart
    (their re-admission hits their own freed blocks and would flatter the rate)."""

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
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    # This step's drafts and acceptances; None when no draft was verified.
    spec_decoding_stats: SpecDecodingStats | None = None
