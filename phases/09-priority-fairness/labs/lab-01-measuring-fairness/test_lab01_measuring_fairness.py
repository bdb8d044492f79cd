"""Lab 09.1 — measuring fairness: queue time, TTFT and TPOT per request and per class.

Graded: the ``LAB 09.1`` regions of ``labs/phase_09/fairness.py``.

First the rules, on timestamps you can check by hand; then percentiles per
priority class (by hand, then against numpy); then whole runs on the step
clock: the scenarios recorded from the pinned upstream
(``tests/snapshots/scheduler/``), where every expected value is read off
upstream's own trace (the step a request first appears among the new
requests, the steps its tokens come back, the step it finishes), and
generated workloads read the same way off their own trace.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import mini_vllm.testing as mini
from mini_vllm.grading import checks
from mini_vllm.grading.checks import lab_settings
from mini_vllm.oracle import snapshots, strategies
from mini_vllm.oracle.workload import first_difference, run_workload

pytestmark = pytest.mark.timeout(20)

PROPERTY = lab_settings(40, shrink=True)
FIELDS = (
    "num_generation_tokens",
    "e2e_latency",
    "queued_time",
    "prefill_time",
    "inference_time",
    "decode_time",
    "mean_time_per_output_token",
    "first_token_latency",
    "num_preemptions",
)


def stats(impl, **fields):
    return impl.fairness.RequestStateStats(**fields)


# ------------------------------------------------------------------ the rules


@pytest.mark.points(2)
def test_only_the_first_admission_counts(impl):
    s = stats(impl)
    impl.fairness.record_scheduled(s, 3.0)
    assert s.scheduled_ts == 3.0, "record_scheduled must set scheduled_ts on the first admission"
    impl.fairness.record_scheduled(s, 7.0)  # resumed after a preemption
    assert s.scheduled_ts == 3.0, (
        "a resumed request was admitted again at 7 and scheduled_ts moved to "
        f"{s.scheduled_ts}: upstream keeps the first admission (stats.py:421, 'ignore "
        "preemptions'), so queue time is the wait before the first admission"
    )


@pytest.mark.points(2)
def test_first_and_last_token(impl):
    s = stats(impl)
    impl.fairness.record_new_tokens(s, 1, 2.0)
    impl.fairness.record_new_tokens(s, 1, 3.0)
    impl.fairness.record_new_tokens(s, 2, 5.0)
    got = (s.first_token_ts, s.last_token_ts, s.num_generation_tokens)
    assert got == (2.0, 5.0, 4), (
        "tokens came back at 2 (one), 3 (one) and 5 (two): expected first_token_ts 2, "
        f"last_token_ts 5 and 4 tokens, got {got}"
    )


@pytest.mark.points(3)
def test_intervals_by_hand(impl):
    # arrival 1, queued 1.5, first admitted 4, first token 6, last token 12,
    # 4 tokens, finished at 13:
    #   e2e 13-1 = 12; queued 4-1.5 = 2.5; prefill 6-4 = 2; decode 12-6 = 6;
    #   inference 12-4 = 8; TPOT 6/(4-1) = 2; TTFT 6-1 = 5.
    s = stats(
        impl,
        arrival_time=1.0,
        queued_ts=1.5,
        scheduled_ts=4.0,
        first_token_ts=6.0,
        last_token_ts=12.0,
        num_generation_tokens=4,
        num_preemptions=1,
    )
    f = impl.fairness.finished_request_stats("a", 2, 9, s, 13.0)
    want = {
        "e2e_latency": 12.0,
        "queued_time": 2.5,
        "prefill_time": 2.0,
        "decode_time": 6.0,
        "inference_time": 8.0,
        "mean_time_per_output_token": 2.0,
        "first_token_latency": 5.0,
        "num_generation_tokens": 4,
        "num_preemptions": 1,
    }
    wrong = {k: (getattr(f, k), v) for k, v in want.items() if getattr(f, k) != v}
    assert not wrong, (
        "timestamps: arrival 1, queued 1.5, admitted 4, first token 6, last 12, 4 tokens, "
        f"finished 13. Wrong (got, expected): {wrong}. TPOT divides the decode time by the "
        "tokens after the first (the prefill made the first); TTFT counts from arrival."
    )
    assert (f.request_id, f.priority, f.num_prompt_tokens) == ("a", 2, 9)


@pytest.mark.points(1)
def test_one_token_has_no_time_per_output_token(impl):
    s = stats(impl, scheduled_ts=0.0, first_token_ts=1.0, last_token_ts=1.0)
    s.num_generation_tokens = 1
    f = impl.fairness.finished_request_stats("a", 0, 3, s, 1.0)
    assert f.mean_time_per_output_token == 0, (
        "a one-token request has no token after the first: upstream reports TPOT 0 "
        f"(stats.py:455-459), got {f.mean_time_per_output_token}"
    )


# ------------------------------------------------------------------ per class


def finished(impl, request_id, priority, ttft, tpot, n=3):
    return impl.fairness.FinishedRequestStats(
        request_id=request_id,
        priority=priority,
        num_prompt_tokens=4,
        num_generation_tokens=n,
        e2e_latency=ttft + 10,
        queued_time=ttft - 1,
        prefill_time=1.0,
        inference_time=10.0,
        decode_time=tpot * (n - 1),
        mean_time_per_output_token=tpot,
        first_token_latency=ttft,
        num_preemptions=0,
    )


@pytest.mark.points(3)
def test_percentiles_by_hand(impl):
    rows = [
        finished(impl, "a", 0, 1.0, 1.0),
        finished(impl, "b", 0, 4.0, 3.0),
        finished(impl, "c", 0, 2.0, 2.0),
        finished(impl, "d", 0, 3.0, 9.0, n=1),  # one token: no TPOT
        finished(impl, "e", 2, 10.0, 5.0),
    ]
    got = impl.fairness.class_percentiles(rows, qs=(50, 90))
    assert list(got) == [0, 2], f"one entry per priority class, in order: got {list(got)}"
    # Class 0 TTFTs sorted: 1, 2, 3, 4. p50 sits at rank 1.5: 2 + 0.5 = 2.5;
    # p90 at rank 2.7: 3 + 0.7 = 3.7. TPOTs of the three multi-token requests:
    # 1, 2, 3: p50 = 2, p90 at rank 1.8: 2 + 0.8 = 2.8.
    want = {"ttft": {50: 2.5, 90: 3.7}, "tpot": {50: 2.0, 90: 2.8}}
    for metric, by_q in want.items():
        for q, value in by_q.items():
            assert math.isclose(got[0][metric][q], value), (
                f"class 0, {metric} p{q}: expected {value}, got {got[0][metric][q]} "
                "(linear interpolation between the two nearest ranks; TPOT leaves out "
                "requests with a single output token)"
            )
    assert got[2]["ttft"] == {50: 10.0, 90: 10.0}, got[2]["ttft"]


@pytest.mark.points(2)
@PROPERTY
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.floats(0, 1000), st.floats(0, 50), st.integers(1, 5)),
        min_size=1,
        max_size=40,
    )
)
def test_percentiles_match_numpy(impl, short_shrink, rows):
    finished_rows = [finished(impl, f"r{i}", p, t, d, n) for i, (p, t, d, n) in enumerate(rows)]
    got = impl.fairness.class_percentiles(finished_rows)
    for priority in {p for p, *_ in rows}:
        mine = [r for r in finished_rows if r.priority == priority]
        for metric, field in impl.fairness.METRICS.items():
            values = [
                getattr(r, field) for r in mine if metric != "tpot" or r.num_generation_tokens > 1
            ]
            for q in (50, 90, 99):
                want = float(np.percentile(values, q)) if values else math.nan
                have = got[priority][metric][q]
                assert (math.isnan(want) and math.isnan(have)) or math.isclose(
                    have, want, rel_tol=1e-9, abs_tol=1e-9
                ), f"class {priority}, {metric} p{q}: numpy says {want}, you {have}"


# ------------------------------------------------------------------ whole runs


def expected_from_trace(workload, trace) -> dict[str, dict]:
    """Each finished request's intervals on the step clock, read off a trace:
    time t is "t steps done", so a request added before step i arrives at i,
    is admitted at i if step i lists it among the new requests, and gets the
    tokens of step i at i + 1."""
    arrival = {s.req_id: float(s.arrive_step) for s in workload.requests}
    scheduled, first, last, count, preempted, done = {}, {}, {}, {}, {}, {}
    for i, step in enumerate(trace["steps"]):
        for req_id, *_ in step["new"]:
            scheduled.setdefault(req_id, float(i))
        for req_id in step["preempted"]:
            preempted[req_id] = preempted.get(req_id, 0) + 1
        for req_id, tokens, reason, _ in step["outputs"]:
            if tokens:
                first.setdefault(req_id, float(i + 1))
                last[req_id] = float(i + 1)
                count[req_id] = count.get(req_id, 0) + len(tokens)
            if reason is not None:
                done[req_id] = float(i + 1)
    want = {}
    for req_id, end in done.items():
        n = count[req_id]
        want[req_id] = {
            "num_generation_tokens": n,
            "e2e_latency": end - arrival[req_id],
            "queued_time": scheduled[req_id] - arrival[req_id],
            "prefill_time": first[req_id] - scheduled[req_id],
            "inference_time": last[req_id] - scheduled[req_id],
            "decode_time": last[req_id] - first[req_id],
            "mean_time_per_output_token": (last[req_id] - first[req_id]) / (n - 1) if n > 1 else 0,
            "first_token_latency": first[req_id] - arrival[req_id],
            "num_preemptions": preempted.get(req_id, 0),
        }
    return want


def compare(impl, workload, expected_trace, source: str) -> None:
    sched = mini.create_scheduler(scheduler_cls=impl.fairness.TimedScheduler, **workload.config)
    trace = run_workload(mini, workload, scheduler=sched)
    diff = first_difference(expected_trace, trace, labels=(source, "TimedScheduler"))
    assert diff is None, f"the timed scheduler changed the schedule itself: {diff}"
    want = expected_from_trace(workload, expected_trace)
    got = {f.request_id: f for f in sched.finished_stats}
    assert set(got) == set(want), (
        f"finished_stats holds {sorted(got)}; the requests that finished in the trace are "
        f"{sorted(want)} (one entry each, when update_from_output reports its finish)"
    )
    for req_id, fields in want.items():
        wrong = {
            k: (getattr(got[req_id], k), v)
            for k, v in fields.items()
            if getattr(got[req_id], k) != v
        }
        assert not wrong, (
            f"{source}, request {req_id} (arrives at step "
            f"{next(s.arrive_step for s in workload.requests if s.req_id == req_id)}): "
            f"wrong (yours, from the trace): {wrong}. Step clock: a request's tokens from "
            "step i arrive at time i + 1; it is admitted at i if step i lists it as new."
        )
        spec = next(s for s in workload.requests if s.req_id == req_id)
        assert got[req_id].priority == spec.priority, f"{req_id}: priority not kept"


@pytest.mark.points(1)
@pytest.mark.parametrize("name", checks.snapshot_names())
def test_upstream_recorded_scenarios(impl, name):
    workload, header, trace = snapshots.load(snapshots.SNAPSHOT_DIR / f"{name}.json")
    compare(impl, workload, trace, f"upstream vLLM {header['vllm_version']} ({name})")


@pytest.mark.points(3)
@pytest.mark.timeout(60)
@PROPERTY
@given(strategies.workloads())
def test_generated_workloads(impl, short_shrink, workload):
    reference = run_workload(mini, workload)
    compare(impl, workload, reference, "the reference scheduler")


@pytest.mark.points(2)
def test_per_class_summary_of_a_run(impl):
    """A priority run under memory pressure: the summary is the percentiles of
    the run's own finished requests, class by class."""
    workload, _, trace = snapshots.load(snapshots.SNAPSHOT_DIR / "preemption_priority.json")
    sched = mini.create_scheduler(scheduler_cls=impl.fairness.TimedScheduler, **workload.config)
    run_workload(mini, workload, scheduler=sched)
    summary = impl.fairness.class_percentiles(sched.finished_stats)
    want = expected_from_trace(workload, trace)
    priority = {s.req_id: s.priority for s in workload.requests}
    for p in sorted(set(priority.values())):
        ttfts = [w["first_token_latency"] for r, w in want.items() if priority[r] == p]
        if not ttfts:
            continue
        assert math.isclose(summary[p]["ttft"][50], float(np.percentile(ttfts, 50))), (
            f"class {p}: median TTFT {summary[p]['ttft'][50]}, from upstream's trace "
            f"{float(np.percentile(ttfts, 50))}"
        )
