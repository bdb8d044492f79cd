"""SSE framing against upstream's own completions stream generator, byte for byte.

mini_vllm's AsyncLLM runs real requests on the tiny seeded Llama (streamed, so
``RequestOutputKind.DELTA``) and the outputs are recorded. The same outputs,
converted field by field to upstream's ``RequestOutput``, go to upstream's
``OpenAIServingCompletion.completion_stream_generator``
(vllm/entrypoints/openai/completion/serving.py:279) and to mini_vllm's, with the
same request body, request id, creation time and system fingerprint, so that
the chunks must be equal as strings: nothing is normalised.

Cases: one prompt; usage at the end and on every chunk; two prompts with n=2
(choice index = prompt index * n + completion index); logprobs; a stop string;
a chunked-prefill output with no token first (sends nothing); an error in the
middle of the stream (an error event, then ``[DONE]``).
"""

from __future__ import annotations

import asyncio

import pytest
from serve_helpers import tiny_text_model

from mini_vllm.engine.async_llm import AsyncLLM, RequestOutputKind
from mini_vllm.entrypoints.openai.protocol import CompletionRequest
from mini_vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from mini_vllm.entrypoints.openai.serving_engine import merge_async_iterators
from mini_vllm.outputs import CompletionOutput, RequestOutput

pytestmark = pytest.mark.upstream

REQUEST_ID, CREATED, MODEL = "cmpl-oracle", 1700000000, "tiny-llama"
PROMPTS = ["The capital of France is", "Once upon a time"]

CASES = {
    "one prompt": {"prompt": PROMPTS[0], "max_tokens": 6},
    "usage": {
        "prompt": PROMPTS[1],
        "max_tokens": 6,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    },
    "two prompts n=2": {
        "prompt": PROMPTS,
        "max_tokens": 5,
        "n": 2,
        "temperature": 0.8,
        "seed": 3,
        "stream_options": {"include_usage": True},
    },
    "logprobs": {"prompt": PROMPTS[0], "max_tokens": 5, "logprobs": 2},
}


@pytest.fixture(scope="module")
def loop():
    """One event loop for the module: an AsyncLLM serves the loop it started on."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def engine(loop):
    engine = AsyncLLM.from_model(
        tiny_text_model(), max_model_len=128, num_gpu_blocks_override=64, device="cpu"
    )
    engine.loop = loop
    yield engine
    engine.shutdown()
    loop.run_until_complete(asyncio.sleep(0))  # let the cancelled output handler end


@pytest.fixture(scope="module")
def upstream_serving():
    from vllm.entrypoints.openai.completion.serving import (
        OpenAIServingCompletion as UpstreamServing,
    )

    from mini_vllm.entrypoints.openai.serving_engine import SYSTEM_FINGERPRINT

    # Only the attributes the stream generator reads (no engine behind it).
    serving = UpstreamServing.__new__(UpstreamServing)
    serving.system_fingerprint = SYSTEM_FINGERPRINT
    serving.enable_force_include_usage = False
    serving.enable_prompt_tokens_details = False
    serving.return_tokens_as_token_ids = False
    return serving


def record(engine: AsyncLLM, body: dict) -> list[tuple[int, RequestOutput]]:
    """Run the request on mini_vllm's engine; the streamed outputs in arrival order."""
    request = CompletionRequest(model=MODEL, stream=True, **body)
    prompts = [request.prompt] if isinstance(request.prompt, str) else request.prompt

    async def run():
        generators = [
            engine.generate(
                prompt,
                request.to_sampling_params(request.max_tokens),
                f"{REQUEST_ID}-{i}",
                n=request.n,
                output_kind=RequestOutputKind.DELTA,
            )
            for i, prompt in enumerate(prompts)
        ]
        return [item async for item in merge_async_iterators(*generators)]

    return engine.loop.run_until_complete(run())


def to_upstream(output: RequestOutput, tokenizer):
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput as UpCompletionOutput
    from vllm.outputs import RequestOutput as UpRequestOutput

    completions = []
    for c in output.outputs:
        logprobs = None
        if c.logprobs is not None:
            logprobs = [
                {
                    token_id: Logprob(lp, rank=rank, decoded_token=tokenizer.decode([token_id]))
                    for rank, (token_id, lp) in enumerate(step.items())
                }
                for step in c.logprobs
            ]
        completions.append(
            UpCompletionOutput(
                index=c.index,
                text=c.text,
                token_ids=list(c.token_ids),
                cumulative_logprob=c.cumulative_logprob,
                logprobs=logprobs,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
        )
    return UpRequestOutput(
        output.request_id,
        output.prompt,
        list(output.prompt_token_ids),
        None,
        completions,
        output.finished,
    )


async def _aiter(items, fail_after: int | None = None):
    for n, item in enumerate(items):
        if n == fail_after:
            raise ValueError("injected failure in the middle of a stream")
        yield item


def both_streams(engine, upstream_serving, body, items, fail_after=None):
    from vllm.entrypoints.openai.completion.protocol import (
        CompletionRequest as UpCompletionRequest,
    )
    from vllm.entrypoints.openai.engine.protocol import RequestResponseMetadata

    num_prompts = 1 if isinstance(body["prompt"], str) else len(body["prompt"])
    mini = OpenAIServingCompletion(engine, [MODEL])
    up_items = [(i, to_upstream(out, engine.tokenizer)) for i, out in items]

    async def collect(generator):
        return [chunk async for chunk in generator]

    mini_chunks = engine.loop.run_until_complete(
        collect(
            mini.completion_stream_generator(
                CompletionRequest(model=MODEL, stream=True, **body),
                _aiter(items, fail_after),
                REQUEST_ID,
                CREATED,
                MODEL,
                num_prompts,
            )
        )
    )
    up_chunks = engine.loop.run_until_complete(
        collect(
            upstream_serving.completion_stream_generator(
                UpCompletionRequest(model=MODEL, stream=True, **body),
                [{"prompt": p} for p in ([body["prompt"]] * num_prompts)],
                _aiter(up_items, fail_after),
                REQUEST_ID,
                CREATED,
                MODEL,
                num_prompts=num_prompts,
                tokenizer=engine.tokenizer,
                request_metadata=RequestResponseMetadata(request_id=REQUEST_ID),
            )
        )
    )
    return mini_chunks, up_chunks


@pytest.mark.parametrize("case", list(CASES))
def test_stream_chunks_equal_upstreams(engine, upstream_serving, case):
    body = CASES[case]
    items = record(engine, body)
    assert len(items) > 2
    mini_chunks, up_chunks = both_streams(engine, upstream_serving, body, items)
    assert mini_chunks == up_chunks
    assert mini_chunks[-1] == "data: [DONE]\n\n"


def test_stop_string_and_an_empty_prefill_output(engine, upstream_serving):
    greedy = {"prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0}
    text = "".join(out.outputs[0].text for _, out in record(engine, greedy))
    body = {**greedy, "stop": [text[len(text) // 2 :][:3]]}
    items = record(engine, body)
    assert items[-1][1].outputs[0].finish_reason == "stop"
    first = items[0][1]
    prefill = RequestOutput(
        first.request_id,
        first.prompt,
        first.prompt_token_ids,
        [CompletionOutput(index=0, text="", token_ids=[], cumulative_logprob=None, logprobs=None)],
        finished=False,
    )
    mini_chunks, up_chunks = both_streams(engine, upstream_serving, body, [(0, prefill), *items])
    assert mini_chunks == up_chunks
    assert len(mini_chunks) == len(items) + 1  # nothing for the prefill output


def test_an_error_mid_stream_is_one_error_event_then_done(engine, upstream_serving):
    body = CASES["one prompt"]
    items = record(engine, body)
    mini_chunks, up_chunks = both_streams(engine, upstream_serving, body, items, fail_after=2)
    assert mini_chunks == up_chunks
    assert '"error"' in mini_chunks[-2] and mini_chunks[-1] == "data: [DONE]\n\n"
