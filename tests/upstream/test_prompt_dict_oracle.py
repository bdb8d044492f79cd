"""Prompt dicts as upstream's renderer takes them, compared with mini_vllm's InputProcessor.

Upstream's path for a decoder-only prompt dict, run on a CPU with a stand-in
tokenizer (only text prompts would use it): ``parse_dec_only_prompt``
(vllm/renderers/inputs/preprocess.py:132), ``_tokenize_singleton_prompt``
(vllm/renderers/base.py:453), ``_process_tokens`` (vllm/renderers/base.py:706).
With both ``prompt`` and ``prompt_token_ids`` the ids run and the text is
reported (an empty one is not); ``prompt`` alone must be text.
"""

from __future__ import annotations

import os
import types

import pytest

from mini_vllm.engine.input_processor import InputProcessor

pytestmark = pytest.mark.upstream

IDS = [5, 6, 7]
CASES = [
    {"prompt": "hello", "prompt_token_ids": IDS},
    {"prompt": "", "prompt_token_ids": IDS},
    {"prompt_token_ids": IDS},
    {"prompt": None, "prompt_token_ids": IDS},
]
REFUSED = [{"prompt": IDS}, {"prompt": {"prompt_token_ids": IDS}}, {"prompt": None}]


@pytest.fixture(scope="module")
def upstream_render():
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    from vllm.renderers.base import BaseRenderer
    from vllm.renderers.inputs.preprocess import parse_dec_only_prompt
    from vllm.renderers.params import TokenizeParams

    renderer = types.SimpleNamespace(tokenizer=None)
    params = TokenizeParams(max_total_tokens=128)

    def render(prompt: dict) -> tuple[object, list[int]]:
        parsed = parse_dec_only_prompt(dict(prompt))
        tokens = BaseRenderer._tokenize_singleton_prompt(renderer, parsed, params)
        engine_input = BaseRenderer._process_tokens(renderer, tokens)
        return engine_input.get("prompt"), engine_input["prompt_token_ids"]

    return render


@pytest.fixture(scope="module")
def processor():
    return InputProcessor(None, 128, 16, None, vocab_size=512)


@pytest.mark.parametrize("prompt", CASES, ids=repr)
def test_a_prompt_dict_runs_and_reports_what_upstream_does(upstream_render, processor, prompt):
    assert processor.tokenize(prompt) == upstream_render(prompt)


@pytest.mark.parametrize("prompt", REFUSED, ids=repr)
def test_prompt_that_is_not_text_is_refused_by_both(upstream_render, processor, prompt):
    with pytest.raises(TypeError, match="Prompt text should be a string"):
        upstream_render(prompt)
    with pytest.raises(ValueError, match="A prompt dict's 'prompt' must be a string"):
        processor.tokenize(prompt)
