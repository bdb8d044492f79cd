"""Unit tests for mini_vllm.request (Request, RequestStatus) and for
mini_vllm.core.sched.utils.check_stop, which decides when a request ends.

Rules checked:
- the order of RequestStatus is the logic: every status after PREEMPTED is a
  finished one, and each finished status maps to an OpenAI finish reason;
- token bookkeeping: num_tokens = prompt + output tokens;
- check_stop looks at, in order: min_tokens (not reached: keep going), EOS,
  stop tokens, then length (max_tokens or max_model_len).
"""

from __future__ import annotations

import pytest

from mini_vllm.core.sched.utils import check_stop, remove_all
from mini_vllm.engine import FinishReason
from mini_vllm.request import Request, RequestStatus
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.testing import EOS_TOKEN_ID, create_requests

# --------------------------------------------------------------------------
# RequestStatus
# --------------------------------------------------------------------------

FINISHED = [
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH_CAPPED,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_IGNORED,
    RequestStatus.FINISHED_ERROR,
    RequestStatus.FINISHED_REPETITION,
]
NOT_FINISHED = [
    RequestStatus.WAITING,
    RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR,
    RequestStatus.WAITING_FOR_REMOTE_KVS,
    RequestStatus.WAITING_FOR_STREAMING_REQ,
    RequestStatus.RUNNING,
    RequestStatus.PREEMPTED,
]


def test_status_lists_cover_the_enum():
    """The two lists below are the whole enum, so the tests cover every status."""
    assert set(FINISHED) | set(NOT_FINISHED) == set(RequestStatus)


@pytest.mark.parametrize("status", FINISHED, ids=str)
def test_finished_statuses_are_finished(status):
    """Every FINISHED_* status counts as finished."""
    assert RequestStatus.is_finished(status)


@pytest.mark.parametrize("status", NOT_FINISHED, ids=str)
def test_live_statuses_are_not_finished(status):
    """The WAITING* statuses, RUNNING and PREEMPTED are not finished; none has a
    finish reason except WAITING_FOR_STREAMING_REQ, which upstream maps to "stop"
    (a streaming request that ends while waiting for more input)."""
    assert not RequestStatus.is_finished(status)
    if status != RequestStatus.WAITING_FOR_STREAMING_REQ:
        assert RequestStatus.get_finished_reason(status) is None


def test_is_finished_follows_from_enum_order():
    """Finished means 'after PREEMPTED' in the enum, so every finished status
    must be declared after every live one."""
    assert max(NOT_FINISHED) == RequestStatus.PREEMPTED
    assert min(FINISHED) > RequestStatus.PREEMPTED


@pytest.mark.parametrize(
    ("status", "reason", "word"),
    [
        (RequestStatus.FINISHED_STOPPED, FinishReason.STOP, "stop"),
        (RequestStatus.FINISHED_LENGTH_CAPPED, FinishReason.LENGTH, "length"),
        (RequestStatus.FINISHED_ABORTED, FinishReason.ABORT, "abort"),
        (RequestStatus.FINISHED_IGNORED, FinishReason.LENGTH, "length"),
        (RequestStatus.FINISHED_ERROR, FinishReason.ERROR, "error"),
        (RequestStatus.FINISHED_REPETITION, FinishReason.REPETITION, "repetition"),
        (RequestStatus.WAITING_FOR_STREAMING_REQ, FinishReason.STOP, "stop"),
    ],
    ids=["stopped", "length", "aborted", "ignored", "error", "repetition", "streaming"],
)
def test_finish_reasons(status, reason, word):
    """Statuses map to the OpenAI-style reasons, as upstream's table does."""
    assert RequestStatus.get_finished_reason(status) is reason
    assert str(reason) == word


def test_status_str_is_its_name():
    """str(status) is the bare name (used in logs and reprs)."""
    assert str(RequestStatus.RUNNING) == "RUNNING"


# --------------------------------------------------------------------------
# Request
# --------------------------------------------------------------------------


def make_request(prompt=(1, 2, 3), **params) -> Request:
    return Request("r", list(prompt), SamplingParams(**params), arrival_time=0.0)


def test_new_request_state():
    """A new request waits, has computed nothing and produced nothing."""
    req = make_request([5, 6, 7], max_tokens=9)
    assert req.status == RequestStatus.WAITING and not req.is_finished()
    assert req.get_finished_reason() is None
    assert (req.num_prompt_tokens, req.num_output_tokens, req.num_tokens) == (3, 0, 3)
    assert req.num_computed_tokens == 0 and req.num_preemptions == 0
    assert req.max_tokens == 9


def test_sampling_params_are_required():
    """A request without sampling params is rejected."""
    with pytest.raises(ValueError):
        Request("r", [1], None)  # type: ignore[arg-type]


def test_appending_output_tokens_updates_every_count():
    """Appending one token or a list grows output and all tokens alike;
    num_tokens is always prompt + output."""
    req = make_request([5, 6, 7])
    req.append_output_token_ids(8)
    req.append_output_token_ids([9, 10])
    assert req.output_token_ids == [8, 9, 10]
    assert req.all_token_ids == [5, 6, 7, 8, 9, 10]
    assert req.prompt_token_ids == [5, 6, 7]
    assert req.num_tokens == req.num_prompt_tokens + req.num_output_tokens == 6


def test_prompt_is_copied():
    """Changing the caller's list afterwards does not change the request."""
    prompt = [1, 2, 3]
    req = make_request(prompt)
    prompt.append(4)
    assert req.prompt_token_ids == [1, 2, 3] and req.num_tokens == 3


def test_request_is_finished_follows_its_status():
    """Request.is_finished() / get_finished_reason() read its current status."""
    req = make_request()
    req.status = RequestStatus.RUNNING
    assert not req.is_finished()
    req.status = RequestStatus.FINISHED_ABORTED
    assert req.is_finished() and req.get_finished_reason() is FinishReason.ABORT


def test_request_order_is_priority_then_arrival_then_id():
    """Requests compare by (priority, arrival_time, request_id): smaller first."""
    a, b, c, d = create_requests(
        4, req_ids=["a", "b", "c", "d"], priorities=[1, 0, 0, 0], arrival_times=[0.0, 2.0, 1.0, 1.0]
    )
    # b, c, d beat a on priority; c and d beat b on arrival; c beats d on id.
    assert sorted([a, b, c, d]) == [c, d, b, a]
    assert not (c < c)


# --------------------------------------------------------------------------
# check_stop
# --------------------------------------------------------------------------


def request_for_stop(
    prompt_len=4, max_tokens=5, min_tokens=0, stop_token_ids=None, ignore_eos=False
) -> Request:
    (req,) = create_requests(
        1,
        num_tokens=prompt_len,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop_token_ids=stop_token_ids,
        ignore_eos=ignore_eos,
    )
    req.status = RequestStatus.RUNNING
    return req


def test_ordinary_token_does_not_stop():
    """A token that is neither EOS nor a stop token, below every limit: keep going."""
    req = request_for_stop()
    req.append_output_token_ids(1)
    assert check_stop(req, max_model_len=100) is False
    assert req.status == RequestStatus.RUNNING and req.stop_reason is None


def test_eos_stops():
    """EOS ends the request as STOPPED, with no stop_reason."""
    req = request_for_stop()
    req.append_output_token_ids(EOS_TOKEN_ID)
    assert check_stop(req, max_model_len=100) is True
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason is None


def test_stop_token_stops_and_is_reported():
    """A stop token ends the request as STOPPED and is kept as stop_reason."""
    req = request_for_stop(stop_token_ids=[42])
    req.append_output_token_ids(42)
    assert check_stop(req, max_model_len=100) is True
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason == 42


def test_max_tokens_caps_length():
    """The max_tokens-th output token ends the request as LENGTH_CAPPED, not before."""
    req = request_for_stop(max_tokens=3)
    for _ in range(2):
        req.append_output_token_ids(1)
        assert check_stop(req, max_model_len=100) is False
    req.append_output_token_ids(1)
    assert check_stop(req, max_model_len=100) is True
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_max_model_len_caps_length():
    """Reaching max_model_len total tokens ends the request as LENGTH_CAPPED
    even if max_tokens would allow more."""
    req = request_for_stop(prompt_len=4, max_tokens=50)
    req.append_output_token_ids(1)  # 5 tokens
    assert check_stop(req, max_model_len=6) is False
    req.append_output_token_ids(1)  # 6 tokens
    assert check_stop(req, max_model_len=6) is True
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_min_tokens_suppresses_eos_and_stop_tokens():
    """Before min_tokens outputs, neither EOS nor a stop token ends the request."""
    req = request_for_stop(min_tokens=3, stop_token_ids=[42])
    req.append_output_token_ids(EOS_TOKEN_ID)
    assert check_stop(req, max_model_len=100) is False
    req.append_output_token_ids(42)
    assert check_stop(req, max_model_len=100) is False
    assert req.status == RequestStatus.RUNNING
    req.append_output_token_ids(EOS_TOKEN_ID)  # 3rd output: min reached
    assert check_stop(req, max_model_len=100) is True
    assert req.status == RequestStatus.FINISHED_STOPPED


def test_eos_wins_over_length_on_the_last_allowed_token():
    """EOS is checked before length: EOS as the max_tokens-th token is STOPPED."""
    req = request_for_stop(max_tokens=1)
    req.append_output_token_ids(EOS_TOKEN_ID)
    assert check_stop(req, max_model_len=100) is True
    assert req.status == RequestStatus.FINISHED_STOPPED


def test_stop_token_wins_over_length_on_the_last_allowed_token():
    """Stop tokens are checked before length too, and stop_reason is set."""
    req = request_for_stop(max_tokens=1, stop_token_ids=[42])
    req.append_output_token_ids(42)
    assert check_stop(req, max_model_len=5) is True
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason == 42


def test_eos_wins_over_a_stop_token_list_containing_it():
    """EOS is checked before stop tokens, so stop_reason stays None."""
    req = request_for_stop(stop_token_ids=[EOS_TOKEN_ID])
    req.append_output_token_ids(EOS_TOKEN_ID)
    assert check_stop(req, max_model_len=100) is True
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason is None


def test_ignore_eos_keeps_going_past_eos():
    """With ignore_eos, EOS is an ordinary token; only length ends the request."""
    req = request_for_stop(max_tokens=2, ignore_eos=True)
    req.append_output_token_ids(EOS_TOKEN_ID)
    assert check_stop(req, max_model_len=100) is False
    req.append_output_token_ids(EOS_TOKEN_ID)
    assert check_stop(req, max_model_len=100) is True
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED


# --------------------------------------------------------------------------
# remove_all
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("items", "remove", "expected"),
    [
        ([1, 2, 3], set(), [1, 2, 3]),
        ([1, 2, 3], {2}, [1, 3]),
        ([1, 2, 3], {9}, [1, 2, 3]),  # absent item: no error
        ([1, 2, 3, 4], {1, 3}, [2, 4]),
    ],
)
def test_remove_all(items, remove, expected):
    """remove_all returns the list without the given items, order kept."""
    assert remove_all(list(items), remove) == expected


def test_request_without_max_tokens_is_a_clear_error():
    """max_tokens=None is legal in SamplingParams (the engine fills it), but a
    Request cannot be built from it: a ValueError says so."""
    import pytest as _pytest

    from mini_vllm.request import Request
    from mini_vllm.sampling_params import SamplingParams

    with _pytest.raises(ValueError, match="max_tokens"):
        Request("r", [1, 2, 3], SamplingParams(max_tokens=None))
