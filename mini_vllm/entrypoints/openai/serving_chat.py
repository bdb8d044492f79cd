"""``/v1/chat/completions``: a conversation in, the assistant's turn out.

Mirrors upstream ``vllm/entrypoints/openai/chat_completion/serving.py``
(``OpenAIServingChat`` :85, ``create_chat_completion`` :228,
``chat_completion_stream_generator`` :400, ``chat_completion_full_generator``
:1006, ``_create_chat_logprobs`` :1467) at v0.22.1, for plain text messages:
the model's own chat template renders the conversation (with the generation
prompt, in the executor thread: see serving_engine.py), then it is one
completion. ``max_completion_tokens`` wins over ``max_tokens`` whenever it is
set, 0 included (then a 400, as upstream).

Logprobs (``logprobs: true``, ``top_logprobs: k``): the engine returns k
alternatives a token (its ``logprobs`` count is ``top_logprobs``); each
choice (each chunk, for a stream) carries ``{"content": [...]}`` with, per
token, its text, logprob (-inf becomes -9999.0) and UTF-8 bytes, and the
first k entries of the engine's dict (the sampled token first).

The stream: for each choice a first chunk with ``delta: {"role":
"assistant", "content": ""}``, then one chunk per new piece of text, the
last with its ``finish_reason``; the usage chunk and ``data: [DONE]`` as for
completions. Left out: tools, reasoning parsers, multimodal content other
than images, ``echo``, custom chat templates, tokens as ids in logprobs.

``return_token_ids``: each choice carries its ``token_ids`` (streamed: each
chunk its new ids) and the response the prompt's ``prompt_token_ids``
(streamed: the first chunk), as upstream (:537-541, :803-807, :1116-1118,
:1402-1404). As upstream without a tool or reasoning parser (:650-656), a
chunk goes out for every output but a chunked prefill's, so a token whose
text is held back (half a UTF-8 character) still sends its id.

Images (Phase 13): for a multimodal model, a message's content may be a list
of parts with ``image_url`` parts holding data URLs (nothing is fetched);
``chat_utils.parse_chat_messages`` decodes them and marks each with the
model's ``<image>`` placeholder, and the engine input carries them as
``multi_modal_data``. A bad image is a 400 for that request alone.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator

from mini_vllm.engine.async_llm import RequestOutputKind
from mini_vllm.entrypoints.chat_utils import parse_chat_messages
from mini_vllm.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
    ErrorResponse,
    UsageInfo,
    random_uuid,
)
from mini_vllm.entrypoints.openai.serving_engine import (
    OpenAIServing,
    make_async,
    should_include_usage,
)
from mini_vllm.outputs import CompletionOutput, RequestOutput
from mini_vllm.sampling_params import SamplingParams

ROLE = "assistant"


class OpenAIServingChat(OpenAIServing):
    def _render_multimodal(self, request: ChatCompletionRequest) -> dict:
        """A multimodal model's engine input: the conversation (text and
        ``image_url`` parts) through the chat template, and its images."""
        tokenizer = self._chat_tokenizer()
        images: list = []
        conversation = parse_chat_messages(request.messages, images=images)
        engine_input: dict = {
            "prompt_token_ids": tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        }
        if images:
            engine_input["multi_modal_data"] = {"image": images}
        return engine_input

    def _chat_tokenizer(self):
        tokenizer = self.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("This model has no chat template.")
        return tokenizer

    def _render(self, request: ChatCompletionRequest) -> list[int]:
        """The conversation through the model's chat template, as token ids."""
        tokenizer = self._chat_tokenizer()
        for message in request.messages:
            if not isinstance(message.get("role"), str) or not isinstance(
                message.get("content"), str
            ):
                raise ValueError(
                    "Each message needs a string 'role' and a string 'content' "
                    "(mini_vllm serves plain text messages)."
                )
        return tokenizer.apply_chat_template(
            request.messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )

    def _prepare(
        self, request: ChatCompletionRequest, request_id: str
    ) -> tuple[dict, SamplingParams]:
        """The engine input and SamplingParams, checked as the engine would
        (blocking: run in the executor)."""
        if self.engine_client.input_processor.mm_processor is not None:
            engine_input = self._render_multimodal(request)
        else:
            engine_input = {"prompt_token_ids": self._render(request)}
        max_tokens = self._validate_prompt_len(
            engine_input["prompt_token_ids"],
            request.max_completion_tokens
            if request.max_completion_tokens is not None
            else request.max_tokens,
        )
        sampling_params = request.to_sampling_params(max_tokens)
        self._validate_engine_input(
            request_id, engine_input, sampling_params, self._maybe_get_adapters(request.model)
        )
        return engine_input, sampling_params

    async def create_chat_completion(
        self, request: ChatCompletionRequest
    ) -> AsyncGenerator[str, None] | ChatCompletionResponse | ErrorResponse:
        if (error := self._check_model(request.model)) is not None:
            return error
        request_id = f"chatcmpl-{random_uuid()}"
        created_time = int(time.time())
        try:
            engine_input, sampling_params = await make_async(self._prepare, self.executor)(
                request, request_id
            )
        except (ValueError, TypeError) as e:
            return self.create_error_response(e)
        lora_request = self._maybe_get_adapters(request.model)
        result_generator = self.engine_client.generate(
            engine_input,
            sampling_params,
            request_id,
            n=request.n,
            output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY,
            lora_request=lora_request,
        )
        if request.stream:
            return self.chat_completion_stream_generator(
                request, result_generator, request_id, created_time, self.model_name(lora_request)
            )
        outputs = [res async for res in result_generator]  # FINAL_ONLY: one
        final_res = outputs[-1]
        return self.chat_completion_full_generator(
            request, final_res, request_id, created_time, self.model_name(lora_request)
        )

    async def chat_completion_stream_generator(
        self,
        request: ChatCompletionRequest,
        result_generator: AsyncIterator[RequestOutput],
        request_id: str,
        created_time: int,
        model_name: str,
    ) -> AsyncGenerator[str, None]:
        num_choices = request.n
        num_prompt_tokens = 0
        previous_num_tokens = [0] * num_choices
        include_usage, include_continuous_usage = should_include_usage(request.stream_options)

        def chunk_of(
            choice: ChatCompletionResponseStreamChoice, **fields
        ) -> ChatCompletionStreamResponse:
            return ChatCompletionStreamResponse(
                id=request_id,
                object="chat.completion.chunk",
                created=created_time,
                choices=[choice],
                model=model_name,
                **fields,
            )

        def usage(completion_tokens: int) -> UsageInfo:
            return UsageInfo(
                prompt_tokens=num_prompt_tokens,
                completion_tokens=completion_tokens,
                total_tokens=num_prompt_tokens + completion_tokens,
            )

        first_iteration = True
        try:
            async for res in result_generator:
                if first_iteration:
                    num_prompt_tokens = len(res.prompt_token_ids)
                    for i in range(num_choices):
                        chunk = chunk_of(
                            ChatCompletionResponseStreamChoice(
                                index=i,
                                delta=DeltaMessage(role=ROLE, content=""),
                                logprobs=None,
                                finish_reason=None,
                            ),
                            # The prompt's ids on the first chunk only (upstream sets
                            # the field, None included, so it is always in the JSON).
                            prompt_token_ids=(
                                res.prompt_token_ids if request.return_token_ids else None
                            ),
                        )
                        if include_continuous_usage:
                            chunk.usage = usage(0)
                        yield f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"
                    first_iteration = False
                for output in res.outputs:
                    i = output.index
                    if not output.text and not output.token_ids and not previous_num_tokens[i]:
                        continue  # a chunked prefill step: nothing to send yet
                    previous_num_tokens[i] += len(output.token_ids)
                    choice = ChatCompletionResponseStreamChoice(
                        index=i,
                        delta=DeltaMessage(content=output.text),
                        logprobs=self._logprobs_of(request, output),
                        token_ids=list(output.token_ids) if request.return_token_ids else None,
                    )
                    if output.finish_reason is not None:
                        choice.finish_reason = output.finish_reason
                        choice.stop_reason = output.stop_reason
                    chunk = chunk_of(choice)
                    if include_continuous_usage:
                        chunk.usage = usage(previous_num_tokens[i])
                    yield f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"
            if include_usage:
                usage_chunk = ChatCompletionStreamResponse(
                    id=request_id,
                    created=created_time,
                    choices=[],
                    model=model_name,
                    usage=usage(sum(previous_num_tokens)),
                    system_fingerprint=self.system_fingerprint,
                )
                yield f"data: {usage_chunk.model_dump_json(exclude_unset=True)}\n\n"
        except Exception as e:
            yield f"data: {self.create_streaming_error_response(e)}\n\n"
        yield "data: [DONE]\n\n"

    def chat_completion_full_generator(
        self,
        request: ChatCompletionRequest,
        final_res: RequestOutput,
        request_id: str,
        created_time: int,
        model_name: str,
    ) -> ChatCompletionResponse:
        choices = [
            ChatCompletionResponseChoice(
                index=output.index,
                message=ChatMessage(role=ROLE, content=output.text),
                logprobs=self._logprobs_of(request, output),
                finish_reason=output.finish_reason,
                stop_reason=output.stop_reason,
                token_ids=list(output.token_ids) if request.return_token_ids else None,
            )
            for output in final_res.outputs
        ]
        num_prompt_tokens = len(final_res.prompt_token_ids)
        num_generated_tokens = sum(len(output.token_ids) for output in final_res.outputs)
        return ChatCompletionResponse(
            id=request_id,
            created=created_time,
            model=model_name,
            choices=choices,
            usage=UsageInfo(
                prompt_tokens=num_prompt_tokens,
                completion_tokens=num_generated_tokens,
                total_tokens=num_prompt_tokens + num_generated_tokens,
            ),
            system_fingerprint=self.system_fingerprint,
            prompt_token_ids=final_res.prompt_token_ids if request.return_token_ids else None,
            kv_transfer_params=final_res.kv_transfer_params,
        )

    def _logprobs_of(
        self, request: ChatCompletionRequest, output: CompletionOutput
    ) -> ChatCompletionLogProbs | None:
        if not request.logprobs or request.top_logprobs is None:
            return None
        return self._create_chat_logprobs(output.token_ids, output.logprobs, request.top_logprobs)

    def _create_chat_logprobs(
        self,
        token_ids: list[int],
        top_logprobs: list[dict[int, float]],
        num_output_top_logprobs: int,
    ) -> ChatCompletionLogProbs:
        """OpenAI's chat logprobs for these tokens (-1: every alternative)."""

        def logprob_of(token_id: int, logprob: float) -> ChatCompletionLogProb:
            token = self.tokenizer.decode([token_id])
            return ChatCompletionLogProb(
                token=token,
                logprob=max(logprob, -9999.0),
                bytes=list(token.encode("utf-8", errors="replace")),
            )

        content = []
        for token_id, step_top_logprobs in zip(token_ids, top_logprobs, strict=True):
            entry = logprob_of(token_id, step_top_logprobs[token_id])
            content.append(
                ChatCompletionLogProbsContent(
                    **entry.model_dump(),
                    top_logprobs=[
                        logprob_of(top_id, logprob)
                        for rank, (top_id, logprob) in enumerate(step_top_logprobs.items())
                        if num_output_top_logprobs == -1 or rank < num_output_top_logprobs
                    ],
                )
            )
        return ChatCompletionLogProbs(content=content)
