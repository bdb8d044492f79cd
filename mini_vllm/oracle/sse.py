"""The SSE oracle: one set of recorded outputs, framed by two stream generators.

mini_vllm-only tooling (no upstream twin), used by
tests/upstream/test_serve_sse_oracle.py and Phase 16's graded suites.
``record`` runs a completion request through an ``AsyncLLM`` as the server
streams it (``RequestOutputKind.DELTA``) and keeps every ``(prompt index,
RequestOutput)`` in arrival order. ``mini_chunks`` feeds them to a
``completion_stream_generator`` (the reference's or a student's);
``upstream_chunks`` converts them field by field to upstream's
``RequestOutput`` and feeds them to the pinned upstream's
``OpenAIServingCompletion.completion_stream_generator``
(vllm/entrypoints/openai/completion/serving.py:279). Both get the same request
body, request id, creation time and system fingerprint, so their chunks can be
compared as strings, nothing normalised. ``fail_after=k`` makes the outputs'
iterator raise before its k-th item (an error in the middle of a stream).
"""

from __future__ import annotations

import asyncio

from mini_vllm.engine.async_llm import AsyncLLM, RequestOutputKind
from mini_vllm.entrypoints.openai.protocol import CompletionRequest
from mini_vllm.entrypoints.openai.serving_engine import SYSTEM_FINGERPRINT, merge_async_iterators
from mini_vllm.outputs import RequestOutput

REQUEST_ID, CREATED, MODEL = "cmpl-oracle", 1700000000, "tiny-llama"


# The request bodies both the SSE oracle test and Lab 16.1 stream.
PROMPTS = ["The capital of France is", "Once upon a time"]
CASES = {
    "one prompt": {"prompt": PROMPTS[0], "max_tokens": 6},
    "usage on every chunk and at the end": {
        "prompt": PROMPTS[1],
        "max_tokens": 6,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    },
    "two prompts, n=2, usage at the end": {
        "prompt": PROMPTS,
        "max_tokens": 5,
        "n": 2,
        "temperature": 0.8,
        "seed": 3,
        "stream_options": {"include_usage": True},
    },
    "logprobs": {"prompt": PROMPTS[0], "max_tokens": 5, "logprobs": 2},
    "token ids, two prompts, n=2": {
        "prompt": PROMPTS,
        "max_tokens": 4,
        "n": 2,
        "temperature": 0.8,
        "seed": 4,
        "return_token_ids": True,
    },
}


def prompts_of(body: dict) -> list:
    return [body["prompt"]] if isinstance(body["prompt"], str) else list(body["prompt"])


def record(
    engine: AsyncLLM, loop: asyncio.AbstractEventLoop, body: dict
) -> list[tuple[int, RequestOutput]]:
    """Run the request on ``engine`` (which serves ``loop``); the streamed
    outputs in arrival order."""
    request = CompletionRequest(model=MODEL, stream=True, **body)

    async def run():
        generators = [
            engine.generate(
                prompt,
                request.to_sampling_params(request.max_tokens),
                f"{REQUEST_ID}-{i}",
                n=request.n,
                output_kind=RequestOutputKind.DELTA,
            )
            for i, prompt in enumerate(prompts_of(body))
        ]
        return [item async for item in merge_async_iterators(*generators)]

    return loop.run_until_complete(run())


async def _aiter(items, fail_after: int | None = None):
    for n, item in enumerate(items):
        if n == fail_after:
            raise ValueError("injected failure in the middle of a stream")
        yield item


async def _collect(generator) -> list[str]:
    return [chunk async for chunk in generator]


def mini_chunks(serving, loop, body: dict, items, fail_after: int | None = None) -> list[str]:
    """The chunks ``serving.completion_stream_generator`` makes of ``items``."""
    generator = serving.completion_stream_generator(
        CompletionRequest(model=MODEL, stream=True, **body),
        _aiter(items, fail_after),
        REQUEST_ID,
        CREATED,
        MODEL,
        len(prompts_of(body)),
    )
    return loop.run_until_complete(_collect(generator))


def to_upstream(output: RequestOutput, tokenizer):
    """mini_vllm's RequestOutput as upstream's, field by field."""
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


def upstream_serving():
    """Upstream's OpenAIServingCompletion with only the attributes its stream
    generator reads (no engine behind it)."""
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    serving = OpenAIServingCompletion.__new__(OpenAIServingCompletion)
    serving.system_fingerprint = SYSTEM_FINGERPRINT
    serving.enable_force_include_usage = False
    serving.enable_prompt_tokens_details = False
    serving.return_tokens_as_token_ids = False
    return serving


def upstream_chunks(
    loop, body: dict, items, tokenizer, fail_after: int | None = None, serving=None
) -> list[str]:
    """The chunks upstream's completion_stream_generator makes of ``items``."""
    from vllm.entrypoints.openai.completion.protocol import (
        CompletionRequest as UpCompletionRequest,
    )
    from vllm.entrypoints.openai.engine.protocol import RequestResponseMetadata

    serving = serving or upstream_serving()
    prompts = prompts_of(body)
    up_items = [(i, to_upstream(out, tokenizer)) for i, out in items]
    generator = serving.completion_stream_generator(
        UpCompletionRequest(model=MODEL, stream=True, **body),
        [{"prompt": p} for p in prompts],
        _aiter(up_items, fail_after),
        REQUEST_ID,
        CREATED,
        MODEL,
        num_prompts=len(prompts),
        tokenizer=tokenizer,
        request_metadata=RequestResponseMetadata(request_id=REQUEST_ID),
    )
    return loop.run_until_complete(_collect(generator))
