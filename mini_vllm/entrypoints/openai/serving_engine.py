"""What the completion and chat handlers share: model check, prompt, errors.

Mirrors upstream ``vllm/entrypoints/openai/engine/serving.py`` (``OpenAIServing``
:132, ``create_error_response`` :174, ``create_streaming_error_response`` :182,
``_check_model`` :218) at v0.22.1, with the module-level
``create_error_response`` (vllm/entrypoints/utils.py:347: how an exception becomes
a status code), ``get_max_tokens`` (vllm/entrypoints/utils.py:175),
``should_include_usage`` (vllm/entrypoints/utils.py:281),
``make_async`` (vllm/utils/async_utils.py:231) and ``merge_async_iterators``
(vllm/utils/async_utils.py:272).

Before the engine sees a request, the handlers prepare it here: tokenize the
prompt (as upstream's renderer does), cap ``max_tokens``, build the
``SamplingParams``, and run the engine's own input checks on the result
(``_validate_engine_input``), so that anything the engine would refuse is a 400
before the first byte of a stream. Upstream runs those checks when the request
is added, after a stream has started (an error event then); mini_vllm runs them
twice instead (here, then in ``AsyncLLM.add_request``). All of it is slow for a
big prompt (a 1 MB prompt takes about a second to tokenize), so it runs in one
worker thread (``make_async``, as upstream's renderer runs its tokenizer in its
executor, vllm/renderers/base.py:89), never on the event loop that answers
every other client. A request whose ``model`` names a ``--lora-modules``
adapter runs with it (``_maybe_get_adapters`` :271, and the answer names the
adapter, as ``OpenAIServingModels.model_name``
(vllm/entrypoints/openai/models/serving.py:137)). Left out: loading adapters at
run time, request logging, tracing headers,
prompt truncation, the system fingerprint's config hash (mini_vllm's is its
name and version).
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from http import HTTPStatus

from mini_vllm.engine.async_llm import AsyncLLM
from mini_vllm.entrypoints.openai.protocol import (
    ErrorInfo,
    ErrorResponse,
    StreamOptions,
    UnsupportedParameterError,
)
from mini_vllm.lora.request import LoRARequest

SYSTEM_FINGERPRINT = "mini_vllm-0.1.0"


class NotFoundError(Exception):
    """Something named in the request does not exist here (404)."""


def create_error_response(
    message: str | Exception,
    err_type: str = "BadRequestError",
    status_code: HTTPStatus = HTTPStatus.BAD_REQUEST,
    param: str | None = None,
) -> ErrorResponse:
    """The OpenAI error JSON; an exception's class picks the status code."""
    if isinstance(message, Exception):
        # BEGIN LAB 16.2: an exception's class picks the error type, status code and param
        # HINT: receives message (an exception); leaves err_type, status_code, param and
        # HINT: message (now the exception's text) for the ErrorResponse below.
        # HINT: check the most specific class first: UnsupportedParameterError (400, its
        # HINT: .parameter), NotFoundError (404), ValueError/TypeError/OverflowError (400,
        # HINT: "BadRequestError"), anything else "InternalServerError" (500). param is None
        # HINT: except for the unsupported parameter.
        exc = message
        if isinstance(exc, UnsupportedParameterError):
            err_type, status_code, param = "BadRequestError", HTTPStatus.BAD_REQUEST, exc.parameter
        elif isinstance(exc, NotFoundError):
            err_type, status_code, param = "NotFoundError", HTTPStatus.NOT_FOUND, None
        elif isinstance(exc, (ValueError, TypeError, OverflowError)):
            err_type, status_code, param = "BadRequestError", HTTPStatus.BAD_REQUEST, None
        else:
            err_type, status_code = "InternalServerError", HTTPStatus.INTERNAL_SERVER_ERROR
            param = None
        message = str(exc)
        # END LAB 16.2
    return ErrorResponse(
        error=ErrorInfo(message=message, type=err_type, code=status_code.value, param=param)
    )


def get_max_tokens(max_model_len: int, max_tokens: int | None, input_length: int) -> int:
    """The requested max_tokens, capped by the room left in the context."""
    # BEGIN LAB 16.2: max_tokens, capped by the room left in the context
    # HINT: receives the model's context length, the request's max_tokens (None: as many
    # HINT: as fit) and the prompt's length; returns a count or raises ValueError.
    # HINT: a prompt longer than the context is a ValueError (a 400); otherwise the room
    # HINT: is what the prompt leaves, and max_tokens never exceeds it.
    if max_model_len < input_length:
        raise ValueError(
            f"Input length ({input_length}) exceeds model's maximum context length "
            f"({max_model_len})."
        )
    room = max_model_len - input_length
    return room if max_tokens is None else min(max_tokens, room)
    # END LAB 16.2


def should_include_usage(stream_options: StreamOptions | None) -> tuple[bool, bool]:
    """(a usage chunk at the end, usage on every chunk too)."""
    if not stream_options:
        return False, False
    include_usage = bool(stream_options.include_usage)
    return include_usage, include_usage and bool(stream_options.continuous_usage_stats)


def make_async(func: Callable, executor: Executor) -> Callable[..., Awaitable]:
    """``func`` as a coroutine function that runs it in ``executor``'s thread."""

    def run(*args, **kwargs) -> Awaitable:
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(executor, functools.partial(func, *args, **kwargs))

    return run


async def merge_async_iterators(*iterators: AsyncIterator) -> AsyncIterator[tuple[int, object]]:
    """Items of several async iterators as they come, as (iterator index, item).

    Closing this generator (a client gone) cancels every iterator still
    running, so each of their requests is aborted."""
    if len(iterators) == 1:
        try:
            async for item in iterators[0]:
                yield 0, item
        finally:
            await iterators[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def drain(index: int, iterator: AsyncIterator) -> None:
        try:
            async for item in iterator:
                await queue.put((index, item))
        except BaseException as e:
            await queue.put((index, e))
            raise
        await queue.put((index, done))

    tasks = [asyncio.create_task(drain(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class OpenAIServing:
    def __init__(
        self,
        engine_client: AsyncLLM,
        served_model_names: list[str],
        executor: Executor | None = None,
        lora_requests: dict[str, LoRARequest] | None = None,
    ) -> None:
        self.engine_client = engine_client
        self.served_model_names = served_model_names
        self.lora_requests = lora_requests or {}  # served adapter name -> LoRARequest
        self.tokenizer = engine_client.tokenizer
        self.max_model_len = engine_client.vllm_config.model_config.max_model_len
        self.system_fingerprint: str | None = SYSTEM_FINGERPRINT
        # One thread for the slow, blocking preparation of requests (handlers
        # may share it: one thread uses the tokenizer at a time).
        self.executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="serve")

    create_error_response = staticmethod(create_error_response)

    def create_streaming_error_response(self, message: str | Exception) -> str:
        return json.dumps(create_error_response(message).model_dump())

    def _check_model(self, model: str | None) -> ErrorResponse | None:
        if not model or model in self.served_model_names or model in self.lora_requests:
            return None
        return create_error_response(
            f"The model `{model}` does not exist.",
            err_type="NotFoundError",
            status_code=HTTPStatus.NOT_FOUND,
            param="model",
        )

    def _maybe_get_adapters(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model)."""
        return self.lora_requests.get(model) if model else None

    def model_name(self, lora_request: LoRARequest | None = None) -> str:
        if lora_request is not None:
            return lora_request.lora_name
        return self.served_model_names[0]

    def _validate_prompt_len(self, token_ids: list[int], max_tokens: int | None) -> int:
        """max_tokens for this prompt; ValueError when no output fits."""
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, your request has {len(token_ids)} input tokens, which leaves "
                "no room for output. Please reduce the length of the input."
            )
        return get_max_tokens(self.max_model_len, max_tokens, len(token_ids))

    def _validate_engine_input(
        self, request_id: str, engine_input: dict, params, lora_request=None
    ) -> None:
        """Raise what the engine's input processor would raise for this input
        (an empty prompt, too many logprobs, a schema xgrammar cannot parse...),
        without queueing anything."""
        self.engine_client.input_processor.process_inputs(
            request_id, engine_input, params, lora_request=lora_request
        )
