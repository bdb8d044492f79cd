"""Logprobs over the OpenAI server with n-gram speculation on.

SmolLM2 continues a repeating list, so the n-gram drafter proposes tokens the
target accepts, and a step emits several tokens. Every one of them must carry
its own logprobs entry in the answer, whole and streamed, with the values the
same greedy request gets offline without speculation (upstream computes them
per output position: RejectionSampler._get_logprobs_tensors,
vllm/v1/sample/rejection_sampler.py:197).
"""

from __future__ import annotations

import openai
import pytest

from mini_vllm.engine.async_llm import AsyncLLM
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.entrypoints.openai.api_server import ServerThread
from mini_vllm.model_executor.model_loader import smollm2_gguf_path
from mini_vllm.sampling_params import SamplingParams

MODEL_NAME = "smollm2"
ENGINE_ARGS = dict(max_model_len=256, kv_cache_memory_bytes=16 << 20, device="cpu")
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}
PROMPT = "red, green, blue, red, green, blue, red, green, blue, red,"
MESSAGES = [
    {"role": "user", "content": "Say: red, green, blue, red, green, blue, red, green, blue"}
]
MAX_TOKENS = 12
TOP = 2


@pytest.fixture(scope="module")
def plain() -> LLM:
    """The reference: the same model offline, without speculation."""
    return LLM(str(smollm2_gguf_path()), **ENGINE_ARGS)


@pytest.fixture(scope="module")
def server():
    path = str(smollm2_gguf_path())
    engine = AsyncLLM.from_model(
        path, model_name=MODEL_NAME, **ENGINE_ARGS, speculative_config=NGRAM
    )
    server = ServerThread(engine, path, MODEL_NAME)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _params() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=TOP)


def _accepted(server) -> int:
    return server.engine.llm_engine.get_stats()["spec_num_accepted_tokens"]


def _assert_entries(got: list[tuple[str, float, dict[str, float]]], want, tokenizer) -> None:
    """One (token, logprob, top) entry per generated token, as the reference's."""
    assert len(got) == len(want.token_ids) == len(want.logprobs)
    for (token, logprob, top), token_id, entry in zip(
        got, want.token_ids, want.logprobs, strict=True
    ):
        assert token == tokenizer.decode([token_id])
        assert logprob == pytest.approx(entry[token_id], abs=1e-4)
        want_top = sorted(entry.values(), reverse=True)[:TOP]
        assert sorted(top.values(), reverse=True)[:TOP] == pytest.approx(want_top, abs=1e-4)


@pytest.mark.parametrize("stream", [False, True])
def test_a_completion_with_logprobs_has_one_entry_per_token(client, server, plain, stream):
    want = plain.generate(PROMPT, _params(), use_tqdm=False)[0].outputs[0]
    before = _accepted(server)
    answer = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        temperature=0,
        max_tokens=MAX_TOKENS,
        logprobs=TOP,
        stream=stream,
    )
    chunks = list(answer) if stream else [answer]
    text, got = "", []
    for chunk in chunks:
        choice = chunk.choices[0]
        text += choice.text
        if choice.logprobs is None:
            continue
        lp = choice.logprobs
        got += list(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True))
    assert _accepted(server) > before, "no draft was accepted: the test would not cover speculation"
    assert text == want.text
    _assert_entries(got, want, plain.get_tokenizer())


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_with_logprobs_has_one_entry_per_token(client, server, plain, stream):
    want = plain.chat(MESSAGES, _params(), use_tqdm=False)[0].outputs[0]
    before = _accepted(server)
    answer = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        temperature=0,
        max_tokens=MAX_TOKENS,
        logprobs=True,
        top_logprobs=TOP,
        stream=stream,
    )
    chunks = list(answer) if stream else [answer]
    text, got = "", []
    for chunk in chunks:
        choice = chunk.choices[0]
        text += (choice.delta.content if stream else choice.message.content) or ""
        if choice.logprobs is None or choice.logprobs.content is None:
            continue
        for entry in choice.logprobs.content:
            top = {t.token: t.logprob for t in entry.top_logprobs}
            got.append((entry.token, entry.logprob, top))
    assert _accepted(server) > before, "no draft was accepted: the test would not cover speculation"
    assert text == want.text
    _assert_entries(got, want, plain.get_tokenizer())
