"""Lab 03 (01.3) — stop strings: find them, cut the text, finish the request.

Graded: the ``LAB 01.3`` regions of ``labs/phase_01/detokenizer.py``:
``check_stop_strings`` and ``IncrementalDetokenizer.update``. Every other
region holds the reference's code while this lab is graded.

Read the tests top to bottom: ``check_stop_strings`` against the pinned
upstream's own function (hypothesis), then rule by rule; ``update`` on a
real tokenizer (SmolLM2's BPE) against upstream's detokenizer and rule by
rule; last, a real run in which a stop string ends a request.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mini_vllm.engine.detokenizer import IncrementalDetokenizer as ReferenceDetokenizer
from mini_vllm.engine.detokenizer import check_stop_strings as reference_check
from mini_vllm.grading.checks import lab_settings
from mini_vllm.oracle import lifecycle
from mini_vllm.sampling_params import SamplingParams

PROPERTY = lab_settings(300, shrink=True)

# Few letters, so that stop strings occur, overlap and repeat.
TEXT = st.text(alphabet="ab c", max_size=14)
STOPS = st.lists(st.text(alphabet="ab c", min_size=1, max_size=4), min_size=0, max_size=3)


def call(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as e:
        pytest.fail(f"{e}: a lab region is not written yet.", pytrace=False)


def explain(text, new, stop, include) -> str:
    return (
        f"check_stop_strings(output_text={text!r}, new_char_count={new}, stop={stop!r}, "
        f"include_in_output={include})"
    )


# ---------------------------------------------------- check_stop_strings


@pytest.mark.upstream
@pytest.mark.points(3)
@pytest.mark.timeout(120)
@PROPERTY
@given(data=st.data(), text=TEXT, stop=STOPS, include=st.booleans())
def test_check_stop_strings_matches_upstream(impl, data, text, stop, include):
    """Same result as upstream's check_stop_strings (vllm/v1/engine/detokenizer.py:309) on
    any text, count of new characters, stop list and include flag."""
    from vllm.v1.engine.detokenizer import check_stop_strings as upstream_check

    new = data.draw(st.integers(0, len(text)), label="new_char_count")
    want = upstream_check(text, new, list(stop), include)
    got = call(impl.detokenizer.check_stop_strings, text, new, list(stop), include)
    assert got == want, (
        f"{explain(text, new, stop, include)}: upstream returns {want!r}, yours {got!r}. "
        "Search each stop string in order, starting len(stop_str) - 1 characters before the "
        "new text; return (stop_str, where to cut), the cut being -1 when the kept stop "
        "string already ends the text."
    )


RULES = [
    # (rule, output_text, new_char_count, stop, include_in_output)
    ("no new characters: nothing to check", "abc", 0, ["b"], False),
    ("no stop strings: nothing to check", "abc", 3, [], False),
    ("cut before the stop string", "hello world", 6, ["wor"], False),
    ("keep the stop string: cut after it", "hello world!", 7, ["wor"], True),
    ("kept stop string ending the text: no cut (-1)", "hello world", 6, ["world"], True),
    ("a stop string straddling old and new text is found", "hello world", 2, ["wor"], False),
    ("a stop string wholly in old text is not found again", "hello world", 1, ["ell"], False),
    (
        "the first stop string in the list wins, not the earliest in the text",
        "xx ab cd",
        5,
        ["cd", "ab"],
        False,
    ),
    ("the first occurrence in the searched window is the cut", "a-b-b", 3, ["b"], False),
]


@pytest.mark.points(1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("rule", "text", "new", "stop", "include"), RULES, ids=[r[0] for r in RULES]
)
def test_check_stop_strings_rules(impl, rule, text, new, stop, include):
    want = reference_check(text, new, stop, include)
    got = call(impl.detokenizer.check_stop_strings, text, new, stop, include)
    assert got == want, (
        f"rule '{rule}': {explain(text, new, stop, include)} should return {want!r}, "
        f"yours returned {got!r}."
    )


# ---------------------------------------------------------------- update


def feed(cls, tok, prompt, output_ids, chunks, params, stop_terminated=False):
    """Feed ``output_ids`` in chunks of ``chunks`` tokens; return the list of
    (stop string returned, output_text, token_ids) after each update, up to the stop."""
    detok = cls(tok, tok.encode(prompt), params=params)
    steps = []
    for i in range(0, len(output_ids), chunks):
        last = i + chunks >= len(output_ids)
        got = call(detok.update, output_ids[i : i + chunks], stop_terminated and last)
        steps.append((got, detok.output_text, list(detok.token_ids)))
        if got is not None:
            break
    return steps


CASES = [
    # (rule, prompt, output text, SamplingParams kwargs, chunk, stop_terminated)
    ("cut before the stop string", "Say:", " one, two. three", dict(stop=["."]), 1, False),
    (
        "include_stop_str_in_output keeps it",
        "Say:",
        " one, two. three",
        dict(stop=["."], include_stop_str_in_output=True),
        1,
        False,
    ),
    (
        "a stop string spread over several tokens is found",
        "Count:",
        " alpha beta gamma delta",
        dict(stop=["a gam"]),
        1,
        False,
    ),
    (
        "several tokens a step: found in the middle of the step",
        "Count:",
        " alpha beta gamma delta",
        dict(stop=["beta"]),
        3,
        False,
    ),
    (
        "the prompt never counts",
        "Stop at STOP.",
        " nothing to see here",
        dict(stop=["STOP"]),
        1,
        False,
    ),
    (
        "no stop string inside the first min_tokens tokens' text",
        "Say:",
        " x. y. z. w.",
        dict(stop=["."], min_tokens=3),
        1,
        False,
    ),
    (
        "tokens crossing min_tokens in one update: only text after the min_tokens-th is searched",
        "Say:",
        " x. y. z. w.",
        dict(stop=["."], min_tokens=2),
        4,
        False,
    ),
    (
        "the first stop string in the list wins",
        "Say:",
        " red green blue",
        dict(stop=["blue", "green"]),
        4,
        False,
    ),
    ("a stop-terminated last token's text is left out", "Say:", " one two three", dict(), 1, True),
    (
        "...unless include_stop_str_in_output",
        "Say:",
        " one two three",
        dict(include_stop_str_in_output=True),
        1,
        True,
    ),
]


@pytest.mark.points(1)
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("rule", "prompt", "text", "kwargs", "chunk", "terminated"), CASES, ids=[c[0] for c in CASES]
)
def test_update_rules(impl, loaded, rule, prompt, text, kwargs, chunk, terminated):
    """update() on SmolLM2's tokenizer: after every call, the stop string it
    returns, output_text and token_ids equal the reference detokenizer's (a
    stop-terminated last token is counted in token_ids even when its text is
    hidden)."""
    tok = loaded.tokenizer
    ids = tok.encode(text)
    params = SamplingParams(**kwargs)
    want = feed(ReferenceDetokenizer, tok, prompt, ids, chunk, params, terminated)
    got = feed(impl.detokenizer.IncrementalDetokenizer, tok, prompt, ids, chunk, params, terminated)
    assert got == want, (
        f"rule '{rule}': prompt {prompt!r}, output {text!r} (tokens "
        f"{[tok.decode([t]) for t in ids]}, {chunk} per update, {kwargs}, stop_terminated="
        f"{terminated}). After each update, (returned stop string, output_text, token_ids) "
        "should be "
        f"{want}, yours {got}."
    )


@pytest.mark.upstream
@pytest.mark.points(2)
@pytest.mark.timeout(180)
@lab_settings(40, shrink=True)
@given(
    words=st.lists(
        st.sampled_from(["the", "cat", "sat", "on", "a", "mat", ".", ",", "ok"]),
        min_size=1,
        max_size=10,
    ),
    data=st.data(),
    include=st.booleans(),
    min_tokens=st.integers(0, 3),
    chunk=st.integers(1, 3),
)
def test_update_matches_upstream_detokenizer(impl, loaded, words, data, include, min_tokens, chunk):
    """The stop string found and the text at that point equal those of
    upstream's own detokenizer (``IncrementalDetokenizer.from_new_request``,
    detokenizer.py:49) fed the same tokens."""
    from vllm.sampling_params import SamplingParams as UpstreamParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer as Upstream

    tok = loaded.tokenizer
    text = " " + " ".join(words)
    stop = data.draw(
        st.lists(
            st.sampled_from(["at", "t s", ".", "on a", "ok", "cat"]),
            min_size=1,
            max_size=2,
            unique=True,
        ),
        label="stop",
    )
    prompt_ids = tok.encode("Story:")
    ids = tok.encode(text)
    kwargs = dict(
        stop=stop, include_stop_str_in_output=include, min_tokens=min_tokens, max_tokens=64
    )
    request = EngineCoreRequest(
        request_id="r",
        prompt_token_ids=prompt_ids,
        mm_features=None,
        sampling_params=UpstreamParams(**kwargs),
        pooling_params=None,
        arrival_time=0.0,
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
    )
    theirs = Upstream.from_new_request(tok, request)
    mine = impl.detokenizer.IncrementalDetokenizer(tok, prompt_ids, params=SamplingParams(**kwargs))
    want = got = None
    for i in range(0, len(ids), chunk):
        want = theirs.update(ids[i : i + chunk], False)
        got = call(mine.update, ids[i : i + chunk], False)
        if want is not None or got is not None:
            break
    sent = f"output {text!r} fed {chunk} tokens at a time, {kwargs}"
    assert got == want, f"{sent}: upstream's detokenizer returns stop {want!r}, yours {got!r}."
    assert mine.output_text == theirs.output_text, (
        f"{sent}: upstream's output_text is {theirs.output_text!r}, yours {mine.output_text!r}."
    )


# ------------------------------------------------------------ a real run


@pytest.mark.points(3)
@pytest.mark.timeout(300)
def test_real_run_stop_string_ends_the_request(impl, reference_run, student_run, workload):
    """In the lifecycle run, the stop-string request ends with finish_reason
    'stop', stop_reason = the string, text cut before it, and the whole run
    (every request, every step) equals the reference's."""
    expected, _ = reference_run
    got, _ = student_run()
    rid = "stop_string"
    stop = workload.params[rid].stop[0]
    want_final = lifecycle.final_outputs(expected)[rid]
    got_final = lifecycle.final_outputs(got)[rid]
    assert (got_final.get("finish_reason"), got_final.get("stop_reason")) == ("stop", stop), (
        f"request {rid!r} with stop={[stop]!r}: its last RequestOutput should say "
        f"finish_reason='stop', stop_reason={stop!r}; yours says "
        f"{got_final.get('finish_reason')!r}, {got_final.get('stop_reason')!r} (text "
        f"{got_final.get('text')!r})."
    )
    assert got_final["text"] == want_final["text"], (
        f"request {rid!r}: the reference's final text is {want_final['text']!r} (cut before "
        f"{stop!r}), yours {got_final['text']!r}."
    )
    diff = lifecycle.first_difference(expected, got)
    assert diff is None, f"your run differs from the reference's: {diff}"
