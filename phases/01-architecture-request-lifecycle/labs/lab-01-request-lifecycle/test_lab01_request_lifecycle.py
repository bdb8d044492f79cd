"""Lab 01.1 — a request's token bookkeeping and its finished state.

Graded: the ``LAB 01.1`` regions of ``labs/phase_01/request.py``:
``Request.append_output_token_ids``, ``num_tokens``, ``num_output_tokens``,
``is_finished`` and ``get_finished_reason``. Every other region holds the
reference's code while this lab is graded.

Read the tests top to bottom: one Request on its own (against the pinned
upstream's ``Request``, then against the reference), then your Request
inside the scheduler on upstream's recorded traces, then a real run where
your Request objects live through WAITING -> RUNNING -> PREEMPTED ->
RUNNING -> FINISHED_* exactly as the reference's do.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import mini_vllm.testing as mini
from mini_vllm.core.kv_cache_utils import get_request_block_hasher, sha256
from mini_vllm.grading.checks import lab_settings
from mini_vllm.oracle import lifecycle
from mini_vllm.oracle.snapshots import SNAPSHOT_DIR, load
from mini_vllm.oracle.workload import first_difference, run_workload
from mini_vllm.request import Request as ReferenceRequest
from mini_vllm.request import RequestStatus
from mini_vllm.sampling_params import SamplingParams

PROPERTY = lab_settings(60, shrink=True)

# A list of appends: each is one token id or a list of them.
APPENDS = st.lists(
    st.one_of(st.integers(0, 999), st.lists(st.integers(0, 999), max_size=5)), max_size=12
)


def make(cls, prompt, block_size=4):
    return cls(
        "r",
        list(prompt),
        SamplingParams(max_tokens=100),
        arrival_time=0.0,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


def call(what, fn):
    try:
        return fn()
    except NotImplementedError as e:
        pytest.fail(f"{e}: a lab region is not written yet.", pytrace=False)


# ------------------------------------------------------------ one Request


@pytest.mark.upstream
@pytest.mark.points(2)
@pytest.mark.timeout(120)
def test_finished_state_matches_upstream(impl):
    """For every status both enums share, is_finished() and
    get_finished_reason() give what upstream's Request gives."""
    from mini_vllm.oracle import upstream as up

    (theirs,) = up.create_requests(1, num_tokens=5)
    mine = call("Request()", lambda: make(impl.request.Request, [1, 2, 3, 4, 5]))
    for status in RequestStatus:
        theirs.status = up.RequestStatus[status.name]
        mine.status = status
        want_done, want_reason = theirs.is_finished(), theirs.get_finished_reason()
        got_done, got_reason = call("", mine.is_finished), call("", mine.get_finished_reason)
        assert got_done == want_done, (
            f"status {status.name}: upstream's Request.is_finished() says {want_done}, yours "
            f"{got_done!r}. Finished means any status after PREEMPTED "
            "(vllm/v1/request.py:337)."
        )
        assert (str(got_reason) if got_reason is not None else None) == (
            str(want_reason) if want_reason is not None else None
        ), (
            f"status {status.name}: upstream's get_finished_reason() gives {want_reason!r} "
            f"({str(want_reason) if want_reason is not None else None!r}), yours "
            f"{got_reason!r}. A live request has no reason (None); FINISHED_STOPPED -> stop, "
            "FINISHED_LENGTH_CAPPED -> length, FINISHED_ABORTED -> abort."
        )


@pytest.mark.points(1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("status", list(RequestStatus), ids=[s.name for s in RequestStatus])
def test_finished_state_of_every_status(impl, status):
    """Without upstream: the same rule, checked against the reference enum's
    own static methods (the order of RequestStatus is the logic)."""
    mine = call("Request()", lambda: make(impl.request.Request, [1, 2, 3]))
    mine.status = status
    want = (RequestStatus.is_finished(status), RequestStatus.get_finished_reason(status))
    got = (call("", mine.is_finished), call("", mine.get_finished_reason))
    assert got == want, (
        f"status {status.name}: (is_finished(), get_finished_reason()) should be {want}, "
        f"yours {got}. Every status after PREEMPTED is finished; the reason comes from "
        "RequestStatus.get_finished_reason (None while the request lives)."
    )


@pytest.mark.upstream
@pytest.mark.points(2)
@pytest.mark.timeout(120)
def test_token_bookkeeping_matches_upstream(impl):
    """The same appends on upstream's Request and yours leave the same counts
    and token lists."""
    from mini_vllm.oracle import upstream as up

    appends = [7, [8, 9], [], 10, [11, 12, 13, 14, 15], 16]
    (theirs,) = up.create_requests(
        1, num_tokens=5, prompt_token_ids=[[1, 2, 3, 4, 5]], block_size=4
    )
    mine = call("Request()", lambda: make(impl.request.Request, [1, 2, 3, 4, 5]))
    for k, tokens in enumerate(appends):
        theirs.append_output_token_ids(tokens)
        call("", lambda tokens=tokens: mine.append_output_token_ids(tokens))
        done = appends[: k + 1]
        for name in ("num_tokens", "num_output_tokens"):
            want, got = getattr(theirs, name), call(name, lambda name=name: getattr(mine, name))
            assert got == want, (
                f"prompt [1, 2, 3, 4, 5], appends {done}: upstream's {name} is {want}, yours "
                f"{got!r}. num_tokens counts prompt + outputs; num_output_tokens only outputs."
            )
        for name in ("output_token_ids", "all_token_ids"):
            assert list(getattr(mine, name)) == list(getattr(theirs, name)), (
                f"prompt [1, 2, 3, 4, 5], appends {done}: upstream's {name} is "
                f"{list(getattr(theirs, name))}, yours {list(getattr(mine, name))}. "
                "append_output_token_ids takes one id or a list, and extends both lists."
            )


@pytest.mark.points(2)
@pytest.mark.timeout(60)
@PROPERTY
@given(prompt=st.lists(st.integers(0, 999), min_size=1, max_size=9), appends=APPENDS)
def test_appends_keep_counts_and_block_hashes(impl, prompt, appends):
    """Any appends leave counts, lists and block hashes equal to the
    reference Request's: one hash per full block, added as blocks fill."""
    ref = make(ReferenceRequest, prompt)
    mine = call("Request()", lambda: make(impl.request.Request, prompt))
    for k, tokens in enumerate(appends):
        ref.append_output_token_ids(tokens)
        call("", lambda tokens=tokens: mine.append_output_token_ids(tokens))
        where = f"prompt {prompt}, appends {appends[: k + 1]}"
        assert (call("", lambda: mine.num_tokens), call("", lambda: mine.num_output_tokens)) == (
            ref.num_tokens,
            ref.num_output_tokens,
        ), (
            f"{where}: (num_tokens, num_output_tokens) should be "
            f"{(ref.num_tokens, ref.num_output_tokens)}, yours "
            f"{(mine.num_tokens, mine.num_output_tokens)}. The invariant: num_tokens == "
            "num_prompt_tokens + num_output_tokens."
        )
        assert list(mine.all_token_ids) == list(ref.all_token_ids), (
            f"{where}: all_token_ids should be {list(ref.all_token_ids)}, yours "
            f"{list(mine.all_token_ids)}."
        )
        assert len(mine.block_hashes) == len(ref.block_hashes), (
            f"{where}: block size 4, {ref.num_tokens} tokens, so {len(ref.block_hashes)} full "
            f"blocks must be hashed, yours has {len(mine.block_hashes)} hashes. Call "
            "self.update_block_hashes() after appending: prefix caching finds blocks by them."
        )
        assert mine.block_hashes == ref.block_hashes, (
            f"{where}: the block hashes differ from the reference's. Hash blocks only through "
            "self.update_block_hashes(), once per append, after both token lists have grown."
        )


# ------------------------------------------------- inside the scheduler


@pytest.mark.points(1)
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "scenario", ["preemption_fcfs", "stop_conditions", "aborts", "prefix_cache_hits"]
)
def test_upstream_traces_with_your_request(impl, scenario, monkeypatch):
    """mini_vllm's scheduler, holding your Request objects, reproduces the
    trace recorded from the pinned upstream (tests/snapshots/scheduler/)."""
    workload, _, expected = load(SNAPSHOT_DIR / f"{scenario}.json")
    monkeypatch.setattr(mini, "Request", impl.request.Request)
    try:
        got = run_workload(mini, workload)
    except NotImplementedError as e:
        pytest.fail(f"{e}: a lab region is not written yet.", pytrace=False)
    diff = first_difference(expected, got)
    assert diff is None, (
        f"scenario {scenario!r}, with your Request in the reference scheduler: {diff}. The "
        "scheduler reads num_tokens / num_output_tokens to decide what to compute, appends "
        "sampled tokens with append_output_token_ids and checks is_finished()."
    )


# ------------------------------------------------------------ a real run


@pytest.mark.points(3)
@pytest.mark.timeout(300)
def test_real_run_status_trace_matches_reference(impl, reference_run, student_run):
    """Five requests on a small KV cache: one preempted and resumed, one
    aborted by the user, one stopped by a stop token, one by a stop string
    (FINISHED_ABORTED in EngineCore: the front end found it), one length
    capped. Each request's status after every step equals the reference's."""
    expected, _ = reference_run
    # The workload covers every transition (checked on the reference's run).
    seen = {s for rec in expected for s in rec.statuses.values()}
    assert {
        "WAITING",
        "RUNNING",
        "PREEMPTED",
        "FINISHED_STOPPED",
        "FINISHED_LENGTH_CAPPED",
        "FINISHED_ABORTED",
    } <= seen, f"workload lost its coverage: {sorted(seen)}"
    got, _ = student_run()
    diff = lifecycle.first_difference(expected, got, fields=("statuses",))
    assert diff is None, (
        f"request statuses differ from the reference's: {diff}. Expected histories: "
        + "; ".join(
            f"{rid}: {' '.join(lifecycle.status_history(expected, rid))}"
            for rid in expected[0].statuses
        )
    )
    diff = lifecycle.first_difference(expected, got)
    assert diff is None, f"statuses agree but the run does not: {diff}"
