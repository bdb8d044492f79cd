"""``LLM.chat`` checks its messages before the chat template runs (issue 29, item 9).

Upstream's rules (vllm/entrypoints/chat_utils.py:1726): ``content`` None or
missing is empty content, so an assistant message that only calls tools is
valid; a malformed message is refused here in one line naming it, where
upstream's parser or the template fails with a traceback. The model is the
tiny seeded Llama with SmolLM2's tokenizer and chat template; the same
normalisation is compared with upstream's own parser in
tests/upstream/test_chat_messages_oracle.py.
"""

from __future__ import annotations

import pytest

from mini_vllm.entrypoints.llm import LLM
from mini_vllm.model_executor.model_loader.tiny import make_tiny_model
from mini_vllm.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=2, temperature=0.0)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("tiny_chat"), arch="llama", tokenizer=True)
    return LLM(str(folder), max_model_len=256, num_gpu_blocks_override=64, device="cpu")


def chat_prompt_ids(llm: LLM, messages) -> list[int]:
    (out,) = llm.chat(messages, PARAMS, use_tqdm=False)
    return out.prompt_token_ids


@pytest.mark.parametrize(
    "message",
    [{"role": "user", "content": None}, {"role": "user"}],
    ids=["content None", "no content"],
)
def test_content_none_or_missing_is_empty_content(llm, message):
    """It used to end in jinja2's error inside the template; upstream renders ""."""
    empty = chat_prompt_ids(llm, [{"role": "user", "content": ""}])
    assert chat_prompt_ids(llm, [message]) == empty


def test_an_assistant_message_that_only_calls_a_tool_is_accepted(llm):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    conversation = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "42"}]},
    ]
    as_text = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": "42"},
    ]
    # SmolLM2's template reads only role and content.
    assert chat_prompt_ids(llm, conversation) == chat_prompt_ids(llm, as_text)
    assert call["function"]["arguments"] == '{"x": 1}'  # the caller's message is unchanged


MALFORMED = [
    (["hi"], "messages\\[0\\] must be a list of message dicts, got str"),
    ([{"role": "user", "content": "a"}, "hi"], "messages\\[1\\] must be a dict with 'role'"),
    ([{"content": "a"}], "messages\\[0\\] has no 'role'"),
    ([{"role": 5, "content": "a"}], "messages\\[0\\]\\['role'\\] must be a string, got int"),
    (
        [{"role": "user", "content": "a"}, {"role": "user", "content": 5}],
        "messages\\[1\\]\\['content'\\] must be a string, a list of content parts or None, got int",
    ),
    (
        [{"role": "user", "content": [{"text": "a"}]}],
        "messages\\[0\\]\\['content'\\]\\[0\\] has no 'type'",
    ),
    (
        [{"role": "user", "content": [{"type": "bogus"}]}],
        "messages\\[0\\]\\['content'\\]\\[0\\]: unsupported content part type 'bogus'",
    ),
    (
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        "parts of type 'image_url' are not supported \\(mini_vllm's chat takes text only\\)",
    ),
    (
        [{"role": "user", "content": [{"type": "text", "text": 5}]}],
        "messages\\[0\\]\\['content'\\]\\[0\\]\\['text'\\] must be a string, got int",
    ),
    (
        [{"role": "assistant", "tool_calls": [{"type": "retrieval"}]}],
        "messages\\[0\\]\\['tool_calls'\\]\\[0\\] must be a call of type 'function'",
    ),
    (
        [
            {
                "role": "assistant",
                "tool_calls": [{"type": "function", "function": {"arguments": "{x"}}],
            }
        ],
        "messages\\[0\\]\\['tool_calls'\\]\\[0\\]\\['function'\\]\\['arguments'\\] is not JSON",
    ),
    ([[{"role": "user", "content": "a"}], [{"role": "user"}, 3]], "messages\\[1\\]\\[1\\] must"),
    ({"role": "user", "content": "a"}, "messages must be a list of message dicts"),
]


@pytest.mark.parametrize(("messages", "error"), MALFORMED, ids=[repr(m)[:50] for m, _ in MALFORMED])
def test_a_malformed_message_is_refused_in_one_line_before_the_template(
    llm, monkeypatch, messages, error
):
    def template_must_not_run(*args, **kwargs):
        raise AssertionError("the chat template ran on a malformed conversation")

    monkeypatch.setattr(llm.get_tokenizer(), "apply_chat_template", template_must_not_run)
    with pytest.raises(ValueError, match=error) as err:
        llm.chat(messages, PARAMS, use_tqdm=False)
    assert "\n" not in str(err.value)
    monkeypatch.undo()
    assert not llm.llm_engine.engine_core.scheduler.requests
    assert chat_prompt_ids(llm, [{"role": "user", "content": "a"}])  # still serves
