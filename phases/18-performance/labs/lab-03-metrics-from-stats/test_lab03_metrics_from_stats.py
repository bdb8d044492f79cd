"""Lab 18.3 — metrics from stats: IterationStats and the Prometheus logger.

Graded: the ``LAB 18.3`` regions of ``labs/phase_18/stats.py`` and
``labs/phase_18/loggers.py``.

Against upstream, live on this CPU (the harness is
mini_vllm/grading/metrics_checks.py, which tests/upstream/test_metrics_prometheus.py
checks the reference with):

1. the stats: the same generated outputs (tokens, engine-core events,
   prefill stats, timestamps, finishes) go through your ``IterationStats``
   and upstream's (vllm/v1/metrics/stats.py:325); every step's fields and
   every request's timestamps must agree;
2. the logger: the same generated steps' stats go to your
   ``PrometheusStatLogger.record`` and upstream's (vllm/v1/metrics/loggers.py:1058);
   after every step the two expositions must agree sample by sample (counters,
   gauges, histogram buckets, counts and sums).
"""

from __future__ import annotations

import pytest

from mini_vllm.grading.checks import written

pytestmark = [pytest.mark.upstream, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def checks():
    return pytest.importorskip("mini_vllm.grading.metrics_checks")


# ------------------------------------------------------------------ the stats


@pytest.mark.points(3)
def test_tokens_ttft_and_inter_token_latencies(impl, checks):
    """update_from_output alone: no events, nobody finishes."""
    checks.stats_follow_upstream(
        impl.stats.IterationStats, 0, 20, events=False, finishes=False, call=written
    )


@pytest.mark.points(3)
def test_events_set_queued_scheduled_and_count_preemptions(impl, checks):
    """update_from_events: QUEUED, the first SCHEDULED only, each PREEMPTED."""
    checks.stats_follow_upstream(
        impl.stats.IterationStats, 1, 20, events=True, finishes=False, call=written
    )


@pytest.mark.points(4)
def test_a_finished_requests_intervals(impl, checks):
    """update_from_finished_request: e2e, queued, prefill, decode, inference, TPOT."""
    checks.stats_follow_upstream(
        impl.stats.IterationStats, 2, 20, events=True, finishes=True, call=written
    )


# ------------------------------------------------------------------ the logger


def logger_agrees(impl, checks, seed: int, num_spec: int | None) -> None:
    mine = impl.loggers.PrometheusStatLogger(checks.logger_config(num_spec), checks.MODEL)
    steps = checks.generated_steps(seed, 30, num_spec)
    checks.expositions_agree(mine, steps, num_spec, call=written)


@pytest.mark.points(4)
@pytest.mark.parametrize("seed", range(2))
def test_the_logger_exposes_as_upstream(impl, checks, seed):
    logger_agrees(impl, checks, seed, None)


@pytest.mark.points(2)
def test_the_logger_with_speculation(impl, checks):
    logger_agrees(impl, checks, 7, 3)
