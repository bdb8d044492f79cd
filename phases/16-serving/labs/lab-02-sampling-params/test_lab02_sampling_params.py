"""Lab 02 (16.2) — an OpenAI request becomes SamplingParams, or a 4xx naming why.

Graded: the ``LAB 16.2`` regions of ``labs/phase_16/protocol.py``
(``_SamplingRequest.check_supported`` and ``sampling_kwargs``) and of
``labs/phase_16/serving_engine.py`` (``create_error_response``'s mapping from
an exception to type, status code and param; ``get_max_tokens``). Every other
region holds the reference's code while this lab is graded.

Your request classes are the reference's ``CompletionRequest`` and
``ChatCompletionRequest`` with your ``_SamplingRequest`` methods under them
(``lab_request``). Tests marked ``upstream`` compare with the pinned
upstream's own ``CompletionRequest.to_sampling_params``
(vllm/entrypoints/openai/completion/protocol.py:240), ``create_error_response``
(vllm/entrypoints/utils.py:347) and ``get_max_tokens``
(vllm/entrypoints/utils.py:175), run on this CPU; the rest are rules, checked
against the reference.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mini_vllm.entrypoints.openai import serving_engine as ref_serving
from mini_vllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    UnsupportedParameterError,
)
from mini_vllm.entrypoints.openai.serving_engine import NotFoundError
from mini_vllm.grading.checks import lab_settings

from phase16_helpers import call

PROPERTY = lab_settings(150, shrink=True)
# The SamplingParams fields both mini_vllm and upstream have.
SHARED = [
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "logprobs",
    "ignore_eos",
    "max_tokens",
    "min_tokens",
    "include_stop_str_in_output",
]
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def lab_request(impl, base: type):
    """``base`` (the reference's request class) with your ``_SamplingRequest``
    methods under it: base -> yours -> the reference's _SamplingRequest."""
    return type(base.__name__, (base, impl.protocol._SamplingRequest), {"__module__": __name__})


def outcome(fn):
    """("ok", value) or ("raises", exception class name)."""
    try:
        return "ok", fn()
    except NotImplementedError as e:
        pytest.fail(f"{e}: a lab region is not written yet.", pytrace=False)
    except Exception as e:  # noqa: BLE001 - the outcome is compared
        return "raises", e


def shared_fields(params) -> dict:
    return {name: getattr(params, name) for name in SHARED}


BODIES = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.one_of(st.none(), st.sampled_from([0.0, 0.5, 1.0, 1.7, -0.5])),
        "top_p": st.one_of(st.none(), st.sampled_from([0.1, 0.9, 1.0, 0.0, 1.5])),
        "top_k": st.one_of(st.none(), st.sampled_from([-1, 0, 1, 20])),
        "seed": st.one_of(st.none(), st.integers(-(2**40), 2**40)),
        "stop": st.one_of(
            st.none(),
            st.text("ab.", max_size=3),
            st.lists(st.text("ab.", min_size=1, max_size=3), max_size=2),
        ),
        "stop_token_ids": st.one_of(st.none(), st.lists(st.integers(0, 100), max_size=3)),
        "logprobs": st.one_of(st.none(), st.integers(0, 5)),
        "ignore_eos": st.booleans(),
        "min_tokens": st.integers(0, 4),
        "include_stop_str_in_output": st.booleans(),
        "user": st.text("xyz", max_size=3),
    },
)


@pytest.mark.upstream
@pytest.mark.points(5)
@pytest.mark.timeout(180)
@PROPERTY
@given(body=BODIES, max_tokens=st.integers(1, 64))
def test_sampling_params_match_upstreams_to_sampling_params(impl, body, max_tokens):
    """Every field both have, as upstream's CompletionRequest.to_sampling_params sets it."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest as UpRequest

    cls = lab_request(impl, CompletionRequest)
    want = outcome(
        lambda: shared_fields(
            UpRequest(model="m", prompt="x", **body).to_sampling_params(max_tokens)
        )
    )
    got = outcome(
        lambda: shared_fields(cls(model="m", prompt="x", **body).to_sampling_params(max_tokens))
    )
    if want[0] == "raises" or got[0] == "raises":
        assert want[0] == got[0], (
            f"request body {body}, max_tokens={max_tokens}: upstream "
            f"{'refuses it (' + repr(want[1]) + ')' if want[0] == 'raises' else 'accepts it'}, "
            f"yours {'refuses it (' + repr(got[1]) + ')' if got[0] == 'raises' else 'accepts it'}"
        )
        return
    assert got[1] == want[1], (
        f"request body {body}, max_tokens={max_tokens}: upstream's SamplingParams has "
        f"{want[1]}, yours {got[1]}. Pass every field SamplingParams has by name; a None "
        "field is left out so that SamplingParams' own default applies."
    )


ERRORS = [
    # (what, mini_vllm's exception, a factory for upstream's)
    ("a bad value: ValueError", ValueError("bad"), lambda: ValueError("bad")),
    ("a wrong type: TypeError", TypeError("bad"), lambda: TypeError("bad")),
    ("a number too large: OverflowError", OverflowError("big"), lambda: OverflowError("big")),
    ("a bug: RuntimeError", RuntimeError("boom"), lambda: RuntimeError("boom")),
    ("a bug: KeyError", KeyError("k"), lambda: KeyError("k")),
    (
        "an unknown name: NotFoundError",
        NotFoundError("gone"),
        lambda: __import__("vllm.exceptions").exceptions.VLLMNotFoundError("gone"),
    ),
    (
        "an unsupported field: UnsupportedParameterError",
        UnsupportedParameterError("min_p", 0.3),
        lambda: __import__("vllm.exceptions").exceptions.VLLMValidationError(
            "unsupported", parameter="min_p"
        ),
    ),
]


def error_fields(response) -> dict:
    error = response.error
    return {"type": error.type, "code": error.code, "param": error.param}


@pytest.mark.upstream
@pytest.mark.points(1)
@pytest.mark.parametrize(("what", "exc", "upstream_exc"), ERRORS, ids=[e[0] for e in ERRORS])
def test_error_type_code_and_param_match_upstream(impl, what, exc, upstream_exc):
    from vllm.entrypoints.utils import create_error_response as upstream_create

    want = error_fields(upstream_create(upstream_exc()))
    got = call(impl.serving_engine.create_error_response, exc)
    assert error_fields(got) == want, (
        f"{what}: upstream answers {want}, yours {error_fields(got)}. The exception's class "
        "picks the type and status code; only a parameter error names a param."
    )
    assert got.error.message == str(exc), (
        f"the message is the exception's text, {str(exc)!r}; yours {got.error.message!r}"
    )


@pytest.mark.upstream
@pytest.mark.points(2)
@pytest.mark.timeout(120)
@PROPERTY
@given(
    max_model_len=st.integers(1, 64),
    max_tokens=st.one_of(st.none(), st.integers(1, 80)),
    input_length=st.integers(1, 80),
)
def test_get_max_tokens_matches_upstream(impl, max_model_len, max_tokens, input_length):
    from vllm.entrypoints.utils import get_max_tokens as upstream_get

    want = outcome(lambda: upstream_get(max_model_len, max_tokens, input_length, {}))
    got = outcome(
        lambda: impl.serving_engine.get_max_tokens(max_model_len, max_tokens, input_length)
    )
    what = f"get_max_tokens({max_model_len}, {max_tokens}, input_length={input_length})"
    assert (want[0], type(want[1]).__name__ if want[0] == "raises" else want[1]) == (
        got[0],
        type(got[1]).__name__ if got[0] == "raises" else got[1],
    ), f"{what}: upstream {want}, yours {got}"


# ------------------------------------------------------------ rules, no pin

# A value that is not the field's default, for every field refused unless at its default.
NOT_DEFAULT = {
    "frequency_penalty": 0.5,
    "presence_penalty": -0.5,
    "repetition_penalty": 1.2,
    "min_p": 0.1,
    "logit_bias": {"42": 5.0},
    "allowed_token_ids": [1, 2],
    "use_beam_search": True,
    "prompt_logprobs": 1,
    "response_format": {"type": "json_object"},
    "echo": True,
    "suffix": "!",
    "top_logprobs": 2,
    "tools": [{"type": "function", "function": {"name": "f"}}],
}


@pytest.mark.points(3)
@pytest.mark.parametrize(
    "base", [CompletionRequest, ChatCompletionRequest], ids=["completion", "chat"]
)
def test_each_unsupported_field_is_refused_naming_it(impl, base):
    cls = lab_request(impl, base)
    extra = {"prompt": "x"} if base is CompletionRequest else CHAT
    assert set(base.UNSUPPORTED) <= set(NOT_DEFAULT)
    for name in base.UNSUPPORTED:
        request = cls(model="m", **extra, **{name: NOT_DEFAULT[name]})
        kind, value = outcome(lambda request=request: request.to_sampling_params(8))
        assert kind == "raises" and isinstance(value, UnsupportedParameterError), (
            f"{base.__name__} with {name}={NOT_DEFAULT[name]!r}: mini_vllm cannot honour "
            f"{name}, so it must raise UnsupportedParameterError (a 400 naming it); yours "
            f"{'returned ' + repr(value) if kind == 'ok' else 'raised ' + repr(value)}. "
            f"Check every name in self.UNSUPPORTED (this class's, which adds its own)."
        )
        assert value.parameter == name, (
            f"{name}={NOT_DEFAULT[name]!r} must be refused naming {name!r}; yours names "
            f"{value.parameter!r}"
        )


@pytest.mark.points(2)
@pytest.mark.parametrize(
    "base", [CompletionRequest, ChatCompletionRequest], ids=["completion", "chat"]
)
def test_an_unsupported_field_sent_at_its_default_is_accepted(impl, base):
    cls = lab_request(impl, base)
    extra = {"prompt": "x"} if base is CompletionRequest else CHAT
    defaults = {
        name: base.model_fields[name].get_default(call_default_factory=True)
        for name in base.UNSUPPORTED
    }
    request = cls(model="m", **extra, **defaults)
    kind, value = outcome(lambda: request.to_sampling_params(8))
    assert kind == "ok", (
        f"a client may send a field mini_vllm cannot honour at its default value (the "
        f"official client sends some explicitly); {defaults} must be accepted, yours raised "
        f"{value!r}"
    )


@pytest.mark.points(1)
def test_a_field_samplingparams_has_is_passed_on_even_if_listed(impl):
    """When SamplingParams gains a field, listing it in UNSUPPORTED no longer refuses it."""
    cls = lab_request(impl, CompletionRequest)
    listed = type(
        "Listed", (cls,), {"__module__": __name__, "UNSUPPORTED": (*cls.UNSUPPORTED, "top_k")}
    )
    kind, value = outcome(lambda: listed(model="m", prompt="x", top_k=5).to_sampling_params(8))
    assert kind == "ok" and value.top_k == 5, (
        "top_k is in UNSUPPORTED here, but SamplingParams has it: skip the names in "
        f"_SAMPLING_PARAMS_FIELDS and pass top_k on. Yours: {value!r}"
    )


MAPPED = [
    (
        "every field set",
        {
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 7,
            "seed": 11,
            "stop": ["."],
            "stop_token_ids": [3],
            "logprobs": 2,
            "ignore_eos": True,
            "min_tokens": 2,
            "include_stop_str_in_output": True,
        },
    ),
    (
        "None: SamplingParams' default",
        {
            "temperature": None,
            "top_p": None,
            "top_k": None,
            "seed": None,
            "stop": None,
            "stop_token_ids": None,
            "logprobs": None,
        },
    ),
    ("nothing sent", {}),
    ("a stop string alone", {"stop": "ab"}),
    ("greedy", {"temperature": 0, "top_k": 5}),
]


@pytest.mark.points(1)
@pytest.mark.parametrize(("what", "body"), MAPPED, ids=[m[0] for m in MAPPED])
@pytest.mark.parametrize(
    "base", [CompletionRequest, ChatCompletionRequest], ids=["completion", "chat"]
)
def test_fields_map_by_name(impl, base, what, body):
    extra = {"prompt": "x"} if base is CompletionRequest else CHAT
    if base is ChatCompletionRequest and body.get("logprobs") is not None:
        body = {k: v for k, v in body.items() if k != "logprobs"}  # a bool in chat
    want = dataclasses.asdict(base(model="m", **extra, **body).to_sampling_params(9))
    kind, got = outcome(
        lambda: lab_request(impl, base)(model="m", **extra, **body).to_sampling_params(9)
    )
    assert kind == "ok", f"{what}: {body} is a valid request; yours raised {got!r}"
    got = dataclasses.asdict(got)
    wrong = {k: (want[k], got[k]) for k in want if want[k] != got[k]}
    assert not wrong, (
        f"{base.__name__} {what} ({body}): SamplingParams differs from the reference's in "
        f"{{field: (expected, yours)}} {wrong}. A field that is None is left out, so "
        "SamplingParams' own default applies."
    )


@pytest.mark.points(1)
def test_a_bad_value_becomes_a_400_naming_the_rule(impl):
    cls = lab_request(impl, CompletionRequest)
    kind, error = outcome(lambda: cls(model="m", prompt="x", temperature=-1).to_sampling_params(8))
    assert kind == "raises" and isinstance(error, ValueError), (
        f"temperature=-1 must raise SamplingParams' ValueError; yours: {error!r}"
    )
    response = call(impl.serving_engine.create_error_response, error)
    assert (response.error.code, response.error.type) == (400, "BadRequestError"), (
        f"a ValueError is the client's fault: 400 BadRequestError; yours "
        f"{response.error.code} {response.error.type}"
    )
    assert "temperature" in response.error.message


RULES = [
    ("an unsupported field: 400 naming it", UnsupportedParameterError("echo", True)),
    ("an unknown model: 404", NotFoundError("The model `x` does not exist.")),
    ("a bad value: 400", ValueError("top_p must be in (0, 1], got 2.0.")),
    ("a wrong type: 400", TypeError("unhashable")),
    ("an overflow: 400", OverflowError("too big")),
    ("a bug: 500", ZeroDivisionError("division by zero")),
    ("not implemented here: 500", NotImplementedError("no")),
]


@pytest.mark.points(1)
@pytest.mark.parametrize(("rule", "exc"), RULES, ids=[r[0] for r in RULES])
def test_error_responses_by_rule(impl, rule, exc):
    want = ref_serving.create_error_response(exc).model_dump()
    try:
        got = impl.serving_engine.create_error_response(exc).model_dump()
    except NotImplementedError as e:
        if "Lab 16.2" in str(e):
            pytest.fail(f"{e}: a lab region is not written yet.", pytrace=False)
        raise
    assert got == want, f"rule '{rule}': expected {want}, yours {got}"
    assert set(got["error"]) == {"message", "type", "param", "code"}


MAX_TOKENS = [
    # (rule, max_model_len, max_tokens, input_length)
    ("room left caps max_tokens", 128, 200, 100),
    ("max_tokens under the room is kept", 128, 5, 100),
    ("None: as many as fit", 128, None, 100),
    ("a prompt filling the context leaves 0", 128, None, 128),
    ("a prompt longer than the context is a ValueError", 128, 4, 129),
]


@pytest.mark.points(1)
@pytest.mark.parametrize(
    ("rule", "max_model_len", "max_tokens", "input_length"),
    MAX_TOKENS,
    ids=[m[0] for m in MAX_TOKENS],
)
def test_max_tokens_rules(impl, rule, max_model_len, max_tokens, input_length):
    def run(fn):
        return outcome(lambda: fn(max_model_len, max_tokens, input_length))

    want, got = run(ref_serving.get_max_tokens), run(impl.serving_engine.get_max_tokens)
    want = (want[0], type(want[1]) if want[0] == "raises" else want[1])
    got = (got[0], type(got[1]) if got[0] == "raises" else got[1])
    assert got == want, (
        f"rule '{rule}': get_max_tokens({max_model_len}, {max_tokens}, {input_length}) should "
        f"give {want}, yours {got}"
    )
