"""Fixtures shared by Phase 03's graded suites."""

from __future__ import annotations

import pytest

import mini_vllm.testing as mini
from mini_vllm.oracle.scenarios import get_scenario
from mini_vllm.oracle.workload import run_workload

# Past this, hypothesis stops shrinking a failure and reports the smallest
# failing workload found so far, so a failing property ends within its time limit.
SHRINK_SECONDS = 15


@pytest.fixture
def finished_lab(request, impl, monkeypatch):
    """``impl``, once one scenario runs without NotImplementedError.

    An unwritten region fails the test at once (hypothesis would otherwise
    spend many seconds shrinking that failure). A test module may name the
    scenario in ``FAIL_FAST_SCENARIO`` (default: preemption_fcfs).
    """
    try:
        from hypothesis.internal.conjecture import engine

        monkeypatch.setattr(engine, "MAX_SHRINKING_SECONDS", SHRINK_SECONDS, raising=False)
    except ImportError:
        pass
    workload = get_scenario(getattr(request.module, "FAIL_FAST_SCENARIO", "preemption_fcfs"))
    try:
        run_workload(
            mini,
            workload,
            scheduler=mini.create_scheduler(
                scheduler_cls=impl.scheduler.Scheduler, **workload.config
            ),
        )
    except NotImplementedError as e:
        pytest.fail(f"{e}: a lab region is not written yet.", pytrace=False)
    except Exception:  # noqa: BLE001 - a real bug: let the property find and shrink it
        pass
    return impl
