"""The fairness benchmark's pieces on a small trace (the full run is `make bench`).

Every case of the benchmark runs to completion on 60 requests of the same
arrival process; each finished request's intervals are consistent with each
other; the aging cases keep the bound they state (checked by the Lab 09.2
checker at every step); and the seconds clock gives times in seconds.
"""

from __future__ import annotations

import math

import mini_vllm.testing as mini
from mini_vllm.benchmarks import fairness as bench
from mini_vllm.core.sched.aging import AgingScheduler
from mini_vllm.grading.aging_checks import watching
from mini_vllm.oracle.workload import Workload, run_workload


def test_every_case_runs_and_its_intervals_add_up():
    specs = bench.arrival_trace(60)
    for case, (cls, extra) in bench.FAKE_CASES.items():
        result = bench.run_fake(specs, cls, extra)
        assert set(result["classes"]) <= {"0", "1", "2"}, case
        config = {**bench.FAKE_CONFIG, **extra}
        sched = mini.create_scheduler(scheduler_cls=cls, **config)
        run_workload(mini, Workload("t", config, specs, max_steps=10**6), scheduler=sched)
        assert len(sched.finished_stats) == len(specs), case
        for f in sched.finished_stats:
            assert f.queued_time >= 0 and f.prefill_time >= 1, (case, f)
            assert math.isclose(f.first_token_latency, f.queued_time + f.prefill_time), (case, f)
            assert math.isclose(f.inference_time, f.prefill_time + f.decode_time), (case, f)
            assert f.mean_time_per_output_token >= 1.0, (case, f)  # at most a token a step


def test_the_aging_cases_keep_their_bound():
    specs = bench.arrival_trace(150)
    for cls, extra in bench.FAKE_CASES.values():
        if issubclass(cls, AgingScheduler):
            config = {**bench.FAKE_CONFIG, **extra}
            sched = mini.create_scheduler(scheduler_cls=watching(cls), **config)
            run_workload(mini, Workload("t", config, specs, max_steps=10**6), scheduler=sched)


def test_the_seconds_clock():
    cls = bench.timed(clock="seconds")
    specs = bench.arrival_trace(8)
    config = {**bench.FAKE_CONFIG, "policy": "fcfs"}
    sched = mini.create_scheduler(scheduler_cls=cls, **config)
    run_workload(mini, Workload("t", config, specs, max_steps=10**6), scheduler=sched)
    assert all(0 <= f.e2e_latency < 60 for f in sched.finished_stats)
    assert any(f.e2e_latency != int(f.e2e_latency) for f in sched.finished_stats)
