"""Upstream's Prometheus logger on a CPU, fed mini_vllm's stats.

The oracle of Phase 18's metrics: ``upstream_logger`` builds the pinned
``PrometheusStatLogger`` (vllm/v1/metrics/loggers.py:404) from a
``VllmConfig`` on the CPU (the stand-in model folder of
``mini_vllm.oracle.upstream``); ``to_upstream`` converts one step's
``SchedulerStats`` and ``IterationStats`` into upstream's dataclasses, field
by field; ``exposition`` reads a Prometheus text exposition into
``{family: (type, help, {(sample, labels): value})}`` so that two can be
compared sample by sample. Upstream registers its metrics in
prometheus_client's global registry: ``upstream_exposition`` reads them from
there.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import mini_vllm.oracle.upstream as _upstream  # the stand-in model folder, and the CPU setup
from mini_vllm.metrics.stats import IterationStats, SchedulerStats

# Upstream's metric families that mini_vllm leaves out (mini_vllm/metrics/loggers.py).
LEFT_OUT = {
    "vllm:engine_sleep_state": "sleep mode",
    "vllm:external_prefix_cache_queries": "the connector's prefix-cache stats",
    "vllm:external_prefix_cache_hits": "the connector's prefix-cache stats",
    "vllm:mm_cache_queries": "the multimodal processor cache",
    "vllm:mm_cache_hits": "the multimodal processor cache",
    "vllm:estimated_flops_per_gpu": "MFU estimates (PerfMetricsProm)",
    "vllm:estimated_read_bytes_per_gpu": "MFU estimates (PerfMetricsProm)",
    "vllm:estimated_write_bytes_per_gpu": "MFU estimates (PerfMetricsProm)",
}


def upstream_logger(max_model_len: int, model_name: str, num_speculative_tokens: int | None):
    """Upstream's PrometheusStatLogger for one engine (its metrics replace any
    vLLM metrics already in the global registry)."""
    from vllm.config import DeviceConfig, ModelConfig, SpeculativeConfig, VllmConfig
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    model_config = ModelConfig(
        model=_upstream._model_dir,
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
        dtype="float32",
        seed=0,
        served_model_name=model_name,
    )
    speculative_config = None
    if num_speculative_tokens is not None:
        speculative_config = SpeculativeConfig(
            method="ngram", num_speculative_tokens=num_speculative_tokens
        )
    vllm_config = VllmConfig(
        model_config=model_config,
        device_config=DeviceConfig(device="cpu"),
        speculative_config=speculative_config,
    )
    return PrometheusStatLogger(vllm_config)


def to_upstream(scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None):
    """The same step's stats as upstream's SchedulerStats and IterationStats
    (each None where mini_vllm's is)."""
    from vllm.v1.engine import FinishReason
    from vllm.v1.metrics import stats as up
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    up_scheduler = None
    if scheduler_stats is not None:
        prefix = scheduler_stats.prefix_cache_stats
        spec = scheduler_stats.spec_decoding_stats
        up_scheduler = up.SchedulerStats(
            num_running_reqs=scheduler_stats.num_running_reqs,
            num_waiting_reqs=scheduler_stats.num_waiting_reqs,
            num_skipped_waiting_reqs=scheduler_stats.num_skipped_waiting_reqs,
            kv_cache_usage=scheduler_stats.kv_cache_usage,
            prefix_cache_stats=up.PrefixCacheStats(**vars(prefix)),
            spec_decoding_stats=None if spec is None else SpecDecodingStats(**vars(spec)),
        )
    up_iteration = None
    if iteration_stats is not None:
        up_iteration = up.IterationStats()
        for name, value in vars(iteration_stats).items():
            if name == "prompt_token_stats":
                value = up.PromptTokenStats(**vars(value))
            elif name == "finished_requests":
                value = [
                    up.FinishedRequestStats(
                        **{**vars(f), "finish_reason": FinishReason(int(f.finish_reason))}
                    )
                    for f in value
                ]
            else:
                value = list(value) if isinstance(value, list) else value
            setattr(up_iteration, name, value)
    return up_scheduler, up_iteration


def exposition(text: str) -> dict[str, tuple[str, str, dict]]:
    """``{family: (type, help, {(sample name, sorted labels): value})}`` of the
    ``vllm:`` families, without the ``_created`` timestamps (they differ)."""
    families = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("vllm:") or family.name.endswith("_created"):
            continue
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for s in family.samples
            if not s.name.endswith("_created")
        }
        families[family.name] = (family.type, family.documentation, samples)
    return families


def upstream_exposition() -> dict[str, tuple[str, str, dict]]:
    """The exposition of upstream's logger (in the global registry)."""
    return exposition(generate_latest(REGISTRY).decode())
