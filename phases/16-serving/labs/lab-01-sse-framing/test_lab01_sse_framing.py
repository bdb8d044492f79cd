"""Lab 01 (16.1) — SSE framing: a RequestOutput becomes ``data: {...}`` events.

Graded: the ``LAB 16.1`` regions of ``labs/phase_16/serving_completion.py``
(``OpenAIServingCompletion.completion_stream_generator``): one event per new
piece of a choice, the usage chunk, the ``data: [DONE]`` terminator. Every
other region holds the reference's code while this lab is graded.

The outputs are recorded once, from the reference AsyncLLM on the tiny model
(mini_vllm/oracle/sse.py ``record``). Your generator and upstream's own
``completion_stream_generator`` (vllm/entrypoints/openai/completion/serving.py:279)
are fed the same outputs, request body, id, creation time and fingerprint: the
events must be equal as strings (tests marked ``upstream``). Then the same
cases rule by rule against the reference generator, which needs no pin.
"""

from __future__ import annotations

import json

import pytest

from mini_vllm.entrypoints.openai.serving_completion import (
    OpenAIServingCompletion as ReferenceServing,
)
from mini_vllm.oracle.sse import CASES as SHARED_CASES
from mini_vllm.oracle.sse import MODEL, PROMPTS, mini_chunks, record, upstream_chunks
from mini_vllm.outputs import CompletionOutput, RequestOutput

from phase16_helpers import chunk_difference, unwritten

CASES = {
    **SHARED_CASES,
    "a stop string, after a chunked-prefill output with no token": {
        "prompt": PROMPTS[1],
        "max_tokens": 12,
        "temperature": 0,
    },
    "an error in the middle of the stream": {"prompt": PROMPTS[0], "max_tokens": 6},
    "two prompts, n=2, usage on every chunk": {
        "prompt": PROMPTS,
        "max_tokens": 4,
        "n": 2,
        "temperature": 0.8,
        "seed": 5,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    },
}
CONTINUOUS = ["usage on every chunk and at the end", "two prompts, n=2, usage on every chunk"]
FAIL_AFTER = {"an error in the middle of the stream": 2}


def _empty_prefill(first: RequestOutput) -> RequestOutput:
    """What a chunked-prefill step yields: no text, no token."""
    empty = CompletionOutput(index=0, text="", token_ids=[], cumulative_logprob=None, logprobs=None)
    return RequestOutput(
        first.request_id, first.prompt, first.prompt_token_ids, [empty], finished=False
    )


@pytest.fixture(scope="session")
def recorded(ref_engine, loop):
    """{case: (request body, outputs)} recorded from the reference engine."""
    out = {}
    for case, body in CASES.items():
        if case.startswith("a stop string"):
            text = "".join(o.outputs[0].text for _, o in record(ref_engine, loop, body))
            body = {**body, "stop": [text[len(text) // 2 :][:3]]}
            items = record(ref_engine, loop, body)
            assert items[-1][1].outputs[0].finish_reason == "stop"
            items = [(0, _empty_prefill(items[0][1])), *items]
        else:
            items = record(ref_engine, loop, body)
        out[case] = (body, items)
    return out


def streams(impl, ref_engine, loop, recorded, case):
    """(the reference's events, yours) for one case."""
    body, items = recorded[case]
    fail_after = FAIL_AFTER.get(case)
    want = mini_chunks(ReferenceServing(ref_engine, [MODEL]), loop, body, items, fail_after)
    serving = impl.serving_completion.OpenAIServingCompletion(ref_engine, [MODEL])
    try:
        got = mini_chunks(serving, loop, body, items, fail_after)
    except NotImplementedError as e:
        pytest.fail(f"{e}: a lab region is not written yet.", pytrace=False)
    unwritten(got, "16.1")
    return want, got


def events(chunks: list[str]) -> list[dict | str]:
    """The JSON of each ``data:`` event ("[DONE]" stays a string)."""
    out = []
    for chunk in chunks:
        assert chunk.startswith("data: ") and chunk.endswith("\n\n"), (
            f"{chunk!r} is not an SSE event: each is 'data: ' + payload + a blank line ('\\n\\n')."
        )
        payload = chunk[len("data: ") : -2]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


@pytest.mark.upstream
@pytest.mark.points(3)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_events_equal_upstreams(impl, ref_engine, loop, recorded, case):
    """Byte for byte what upstream's completion_stream_generator sends for the same outputs."""
    body, items = recorded[case]
    _, got = streams(impl, ref_engine, loop, recorded, case)
    want = upstream_chunks(loop, body, items, ref_engine.tokenizer, FAIL_AFTER.get(case))
    diff = chunk_difference(want, got)
    assert diff is None, f"case {case!r} (request body {body}): {diff}"


@pytest.mark.points(2)
@pytest.mark.timeout(120)
def test_every_event_is_data_json_and_a_blank_line_then_done(impl, ref_engine, loop, recorded):
    want, got = streams(impl, ref_engine, loop, recorded, "one prompt")
    parsed = events(got)
    assert parsed[-1] == "[DONE]", (
        f"the last event must be 'data: [DONE]\\n\\n' (the OpenAI client stops on it); "
        f"yours is {got[-1]!r}"
    )
    assert "[DONE]" not in parsed[:-1], "'[DONE]' is sent once, last"
    diff = chunk_difference(want, got, ("reference", "yours"))
    assert diff is None, (
        "each chunk is CompletionStreamResponse(...).model_dump_json(exclude_unset=True), with "
        f"every choice field passed (index, text, logprobs, finish_reason, stop_reason, "
        f"prompt_token_ids, token_ids): {diff}"
    )


@pytest.mark.points(2)
@pytest.mark.timeout(120)
def test_a_prefill_output_with_no_token_sends_nothing(impl, ref_engine, loop, recorded):
    case = "a stop string, after a chunked-prefill output with no token"
    want, got = streams(impl, ref_engine, loop, recorded, case)
    body, items = recorded[case]
    assert len(got) == len(want) == len(items), (
        f"{len(items)} outputs, the first with no text and no token (a chunked prefill): the "
        f"reference sends {len(want)} events (one per output with something new, then [DONE]), "
        f"yours {len(got)}. Skip an output with no text, no tokens and nothing sent before."
    )
    parsed = events(got)
    assert parsed[-2]["choices"][0]["finish_reason"] == "stop", (
        "the stop string's chunk carries finish_reason 'stop'"
    )
    assert parsed[-2]["choices"][0]["stop_reason"] == body["stop"][0], (
        "and stop_reason: the stop string itself"
    )
    diff = chunk_difference(want, got, ("reference", "yours"))
    assert diff is None, diff


@pytest.mark.points(3)
@pytest.mark.timeout(120)
def test_choice_index_is_prompt_index_times_n_plus_completion_index(
    impl, ref_engine, loop, recorded
):
    case = "two prompts, n=2, usage at the end"
    want, got = streams(impl, ref_engine, loop, recorded, case)
    _, items = recorded[case]
    want_index = [i * 2 + out.outputs[0].index for i, out in items]
    got_index = [e["choices"][0]["index"] for e in events(got)[:-2]]
    assert got_index == want_index, (
        f"two prompts with n=2 make four choices: prompt i's completion j is choice i * n + j. "
        f"The outputs came from (prompt, completion) "
        f"{[(i, out.outputs[0].index) for i, out in items]}, so the choices are {want_index}; "
        f"yours are {got_index}"
    )
    diff = chunk_difference(want, got, ("reference", "yours"))
    assert diff is None, diff


@pytest.mark.points(3)
@pytest.mark.timeout(120)
def test_the_usage_chunk_comes_last_with_no_choices(impl, ref_engine, loop, recorded):
    case = "two prompts, n=2, usage at the end"
    want, got = streams(impl, ref_engine, loop, recorded, case)
    _, items = recorded[case]
    usage = events(got)[-2]
    prompt_tokens = sum({i: len(out.prompt_token_ids) for i, out in items}.values())
    completion_tokens = sum(len(out.outputs[0].token_ids) for _, out in items)
    assert isinstance(usage, dict) and usage.get("choices") == [], (
        f"with stream_options.include_usage the event before [DONE] is the usage chunk, with "
        f"choices == []; yours is {got[-2]!r}"
    )
    assert usage.get("usage") == {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }, (
        f"usage sums every prompt ({prompt_tokens} tokens) and every choice "
        f"({completion_tokens} tokens); yours: {usage.get('usage')}"
    )
    diff = chunk_difference(want[-2:], got[-2:], ("reference", "yours"))
    assert diff is None, (
        "the usage chunk carries the system fingerprint and is dumped with exclude_none "
        f"(so 'object' is there, None fields are not): {diff}"
    )
    assert "usage" not in got[0] and "system_fingerprint" not in got[-3], (
        "without continuous_usage_stats the choice chunks carry no usage, and with a usage "
        "chunk following, no fingerprint either"
    )


@pytest.mark.points(2)
@pytest.mark.timeout(120)
def test_fingerprint_on_each_choices_last_chunk_without_usage(impl, ref_engine, loop, recorded):
    want, got = streams(impl, ref_engine, loop, recorded, "one prompt")
    parsed = events(got)[:-1]
    marked = [k for k, e in enumerate(parsed) if "system_fingerprint" in e]
    assert marked == [len(parsed) - 1], (
        f"no usage chunk follows, so the system fingerprint rides on the choice's last chunk "
        f"(the one with a finish_reason) and on no other: yours is on events {marked} of "
        f"{len(parsed)}"
    )
    assert all("usage" not in e for e in parsed), "no usage anywhere without stream_options"
    diff = chunk_difference(want, got, ("reference", "yours"))
    assert diff is None, diff


@pytest.mark.points(2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", CONTINUOUS)
def test_continuous_usage_counts_each_choices_tokens_so_far(impl, ref_engine, loop, recorded, case):
    want, got = streams(impl, ref_engine, loop, recorded, case)
    _, items = recorded[case]
    so_far, expected = {}, []  # so_far: {(prompt index, choice index): tokens}
    for prompt_idx, out in items:
        prompt = len(out.prompt_token_ids)
        for choice in out.outputs:
            key = (prompt_idx, choice.index)
            so_far[key] = so_far.get(key, 0) + len(choice.token_ids)
            expected.append(
                {
                    "prompt_tokens": prompt,
                    "total_tokens": prompt + so_far[key],
                    "completion_tokens": so_far[key],
                }
            )
    got_usage = [e.get("usage") for e in events(got)[: len(expected)]]
    assert got_usage == expected, (
        "with continuous_usage_stats every choice chunk carries the usage so far: its "
        "prompt's tokens and this choice's tokens up to and including the chunk (not every "
        f"choice's). Expected {expected}, yours {got_usage}"
    )
    diff = chunk_difference(want, got, ("reference", "yours"))
    assert diff is None, diff


@pytest.mark.points(2)
@pytest.mark.timeout(120)
def test_logprob_offsets_continue_across_chunks(impl, ref_engine, loop, recorded):
    want, got = streams(impl, ref_engine, loop, recorded, "logprobs")
    parsed = events(got)[:-1]
    offsets = [e["choices"][0]["logprobs"]["text_offset"][0] for e in parsed]
    texts = [e["choices"][0]["text"] for e in parsed]
    expected = [sum(len(t) for t in texts[:k]) for k in range(len(texts))]
    assert offsets == expected, (
        "each chunk's first text_offset is where its text starts in the whole completion (the "
        f"length of the text sent before it): expected {expected}, yours {offsets}"
    )
    diff = chunk_difference(want, got, ("reference", "yours"))
    assert diff is None, diff


@pytest.mark.points(2)
@pytest.mark.timeout(120)
def test_an_error_mid_stream_is_one_error_event_then_done(impl, ref_engine, loop, recorded):
    want, got = streams(impl, ref_engine, loop, recorded, "an error in the middle of the stream")
    parsed = events(got)
    assert parsed[-1] == "[DONE]", (
        f"after an error the stream still ends with 'data: [DONE]\\n\\n'; yours ends {got[-1]!r}"
    )
    assert isinstance(parsed[-2], dict) and "error" in parsed[-2], (
        f"the failure is one event holding the error JSON, just before [DONE]; yours: {got[-2]!r}"
    )
    assert len(got) == FAIL_AFTER["an error in the middle of the stream"] + 2, (
        "the two outputs before the failure are sent, then the error, then [DONE]"
    )
    diff = chunk_difference(want, got, ("reference", "yours"))
    assert diff is None, diff
