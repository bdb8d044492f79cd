"""mini_vllm's chat message parser against upstream's, on the same messages.

Upstream's ``parse_chat_messages`` (vllm/entrypoints/chat_utils.py:1845) runs
on a CPU with a stand-in model config (text-only, no prompt embeddings) in
the "string" content format, SmolLM2's. Messages upstream accepts must give
the same conversation; messages mini_vllm refuses must be ones upstream fails
on too, except the one place mini_vllm is stricter (a role that is not a
string, which upstream passes on to the template), checked as such.
"""

from __future__ import annotations

import copy
import os
import types

import pytest

from mini_vllm.entrypoints.chat_utils import parse_chat_messages

pytestmark = pytest.mark.upstream

CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}

ACCEPTED = [
    [{"role": "user", "content": None}],
    [{"role": "user"}],
    [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
    [{"role": "user", "content": [{"type": "text", "text": "a"}, "b", {"type": "text"}]}],
    [{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "refusal"}]}],
    [{"role": "user", "content": [{"type": "thinking", "thinking": "t"}]}],
    [{"role": "assistant", "tool_calls": [CALL]}],
    [{"role": "assistant", "content": "x", "tool_calls": []}],
    [{"role": "assistant", "content": "x", "tool_calls": None, "reasoning": "r"}],
    [{"role": "assistant", "tool_calls": [{"function": {"name": "g", "arguments": ""}}]}],
    [{"role": "tool", "content": [{"type": "text", "text": "r"}], "tool_call_id": "c1"}],
    [{"role": "user", "content": "x", "name": "bob", "extra": 1}],
    [{"role": "robot", "content": "x", "name": 5}],
    [],
]

REFUSED_BY_BOTH = [
    ["hi"],
    [{"content": "x"}],
    [{"role": "user", "content": 5}],
    [{"role": "user", "content": [{"text": "x"}]}],
    [{"role": "user", "content": [{"type": "bogus"}]}],
    [{"role": "user", "content": [{"type": "text", "text": 5}]}],
    [{"role": "user", "content": [5]}],
    [{"role": "assistant", "tool_calls": [{"type": "retrieval"}]}],
    [{"role": "assistant", "tool_calls": ["call"]}],
    [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": "{"}}]}],
]


@pytest.fixture(scope="module")
def upstream_parse():
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    from vllm.entrypoints.chat_utils import parse_chat_messages as upstream

    model_config = types.SimpleNamespace(
        enable_prompt_embeds=False,
        multimodal_config=None,
        is_multimodal_model=False,
        hf_config=None,
        allowed_local_media_path="",
        allowed_media_domains=None,
    )

    def parse(messages):
        conversation, mm_data, _ = upstream(copy.deepcopy(messages), model_config, "string")
        assert mm_data is None
        return conversation

    return parse


@pytest.mark.parametrize("messages", ACCEPTED, ids=[repr(m)[:60] for m in ACCEPTED])
def test_accepted_messages_give_upstreams_conversation(upstream_parse, messages):
    assert parse_chat_messages(copy.deepcopy(messages)) == upstream_parse(messages)


@pytest.mark.parametrize("messages", REFUSED_BY_BOTH, ids=[repr(m)[:60] for m in REFUSED_BY_BOTH])
def test_refused_messages_fail_upstream_too(upstream_parse, messages):
    with pytest.raises(ValueError):
        parse_chat_messages(copy.deepcopy(messages))
    with pytest.raises(Exception):  # noqa: B017 (upstream's errors are KeyError, TypeError, ...)
        upstream_parse(messages)


def test_a_role_that_is_not_a_string_is_where_mini_is_stricter(upstream_parse):
    messages = [{"role": 5, "content": "x"}]
    assert upstream_parse(messages) == [{"role": 5, "content": "x"}]
    with pytest.raises(ValueError, match="'role'\\] must be a string"):
        parse_chat_messages(messages)
