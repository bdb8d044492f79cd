"""Checks the graded suites share: a scheduler against upstream's snapshots,
and against the reference on generated workloads.

Both return None or a message; a crash, a run in which no request advances
(``no request advanced for N steps``) or one that never ends in the code
under grade becomes a message too (only NotImplementedError, an
unwritten lab region, propagates).

``lab_settings`` is the hypothesis profile every graded property shares.

Both checks run the loop upstream's EngineCore runs (``schedule()`` -> fake model
-> ``update_from_output()``) and compare every step; a failure names the
first step and field that differ, upstream's (or the reference's) value and
the student's.
"""

from __future__ import annotations

import dataclasses
import traceback

import pytest
from hypothesis import HealthCheck, Phase, settings

import mini_vllm.testing as testing
from mini_vllm.oracle import snapshots
from mini_vllm.oracle.workload import Stalled, Workload, first_difference, run_workload
from mini_vllm.tiers import examples

YOURS = "your scheduler"


def written(fn, *args, **kwargs):
    """``fn(*args)``, failing the test at once (no traceback, no shrinking)
    when it reaches a lab region still raising NotImplementedError."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as e:
        pytest.fail(f"{e}: a lab region is not written yet.", pytrace=False)


def engine_greedy_tokens(engine, texts: list[str], max_tokens: int) -> list[list[int]]:
    """Greedy tokens of ``texts`` (EOS ignored) through an ``LLMEngine``
    stepped by hand, in prompt order; an unwritten region fails the test."""
    from mini_vllm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, text in enumerate(texts):
        engine.add_request(str(i), text, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in written(engine.step):
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[str(i)] for i in range(len(texts))]


def lab_settings(max_examples: int, *, shrink: bool = False) -> settings:
    """Hypothesis settings for a graded property: the same examples on every
    run (derandomized, no example database, so a student's score does not
    move between runs) and no deadline (the machine may be slow).

    ``max_examples`` is the grade's count. The fast test tier
    (MINI_VLLM_TIER=fast, what ``make test`` runs on the reference and the
    starters) runs a quarter of it, at least 10: a student's
    ``make check-phase-NN`` leaves the tier unset and gets the full count.

    One failure is reported (``report_multiple_bugs=False``). By default it is
    the first found, as found (no shrinking), which suits a lockstep whose
    examples are whole workloads; ``shrink=True`` shrinks it to a smaller
    example first, for properties whose inputs read better small (a free
    queue's operations, a stop string)."""
    return settings(
        max_examples=examples(max_examples, max(10, max_examples // 4)),
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate, *([Phase.shrink] if shrink else [])],
        report_multiple_bugs=False,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.function_scoped_fixture,
        ],
    )


def _run(scheduler_cls: type, workload: Workload, max_steps: int | None):
    """The student's trace, or a message saying how the run went wrong.
    NotImplementedError (an unwritten region) propagates as it is."""
    if max_steps is not None:
        workload = dataclasses.replace(workload, max_steps=max_steps)
    try:
        scheduler = testing.create_scheduler(**workload.config, scheduler_cls=scheduler_cls)
        return run_workload(testing, workload, scheduler=scheduler), None
    except NotImplementedError:
        raise
    except Stalled as e:
        return None, str(e)
    except RuntimeError as e:
        if "did not finish" not in str(e):
            return None, crash_message(e)
        return None, (
            f"{e}: the reference finishes it in far fewer steps. Some request is "
            "never scheduled again or never finishes: look for a count that stops "
            "advancing."
        )
    except Exception as e:  # noqa: BLE001 - a bug in the code under grade, told in words
        return None, crash_message(e)


def crash_message(error: BaseException) -> str:
    """Where the code under grade raised, in one sentence."""
    where = traceback.extract_tb(error.__traceback__)[-1]
    return (
        f"{YOURS} raised {type(error).__name__}: {error} at `{where.line}` "
        f"(line {where.lineno} of {where.filename})."
    )


def snapshot_names() -> list[str]:
    return sorted(p.stem for p in snapshots.SNAPSHOT_DIR.glob("*.json"))


def snapshot_mismatch(scheduler_cls: type, name: str, max_steps: int | None = None) -> str | None:
    """None if ``scheduler_cls`` reproduces the snapshot recorded from the
    pinned upstream, else what differs first."""
    workload, header, expected = snapshots.load(snapshots.SNAPSHOT_DIR / f"{name}.json")
    got, failure = _run(scheduler_cls, workload, max_steps)
    if failure is not None:
        return f"Scenario {name!r} (mini_vllm/oracle/scenarios.py): {failure}"
    upstream = f"upstream vLLM {header['vllm_version']}"
    diff = first_difference(expected, got, labels=(upstream, YOURS))
    if diff is None:
        return None
    return (
        f"Scenario {name!r} (scheduler config {workload.config}) as recorded from "
        f"{upstream}, against {YOURS}:\n{diff}\n"
        f"Replay it: mini_vllm/oracle/scenarios.py defines the workload; "
        f"`make scheduler-demo` shows a trace step by step."
    )


def reference_mismatch(
    scheduler_cls: type, workload: Workload, max_steps: int | None = None
) -> str | None:
    """None if ``scheduler_cls`` and the reference Scheduler produce the same
    trace on ``workload`` (the reference equals upstream step for step:
    tests/upstream/test_lockstep.py)."""
    expected = run_workload(testing, workload)
    got, diff = _run(scheduler_cls, workload, max_steps)
    if got is not None:
        diff = first_difference(expected, got, labels=("reference", YOURS))
    if diff is None:
        return None
    requests = [(s.req_id, len(s.prompt_token_ids), s.max_tokens) for s in workload.requests]
    return (
        f"{diff}\nscheduler config: {workload.config}\n"
        f"requests (id, prompt length, max_tokens): {requests}"
    )
