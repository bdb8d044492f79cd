"""``/v1/completions``: prompts in, text out, whole or as a server-sent-event stream.

Mirrors upstream ``vllm/entrypoints/openai/completion/serving.py``
(``OpenAIServingCompletion`` :54, ``create_completion`` :110,
``completion_stream_generator`` :279, ``request_output_to_completion_response``
:476, ``_create_completion_logprobs`` :605) at v0.22.1.

The stream, for the features mini_vllm has, is upstream's byte for byte (the
tests feed both generators the same outputs): one ``data: {json}\\n\\n`` event per
new piece of a choice (choice index = prompt index * n + completion index),
``exclude_unset`` JSON with every choice field present; nothing for a step
that made no token (a chunked prefill); the system fingerprint on a choice's
last chunk unless a usage chunk follows; with ``stream_options.include_usage``
a last chunk with no choices and the usage; an error as one ``data:`` event
holding the error JSON; and ``data: [DONE]\\n\\n`` always last.
With ``return_token_ids`` each choice carries its ``token_ids`` and the
prompt's ``prompt_token_ids`` (streamed: each chunk its new ids, a choice's
first chunk the prompt's), as upstream (:365-366, :409-414, :563-568).
Left out: echo, suffix, beam search, prompt logprobs, prompt-token details,
prompt embeddings.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator

from mini_vllm.engine.async_llm import RequestOutputKind
from mini_vllm.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    ErrorResponse,
    UsageInfo,
    random_uuid,
)
from mini_vllm.entrypoints.openai.serving_engine import (
    OpenAIServing,
    make_async,
    merge_async_iterators,
    should_include_usage,
)
from mini_vllm.outputs import RequestOutput
from mini_vllm.sampling_params import SamplingParams


class OpenAIServingCompletion(OpenAIServing):
    def _prompts(self, request: CompletionRequest) -> list[dict]:
        """The request's prompts as engine inputs (text and token ids)."""
        prompt = request.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise ValueError("prompt must not be empty.")
        inputs = []
        for p in prompt:
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError("This model has no tokenizer: send token ids.")
                inputs.append({"prompt": p, "prompt_token_ids": self.tokenizer.encode(p)})
            else:
                inputs.append({"prompt_token_ids": p})
        return inputs

    def _prepare(
        self, request: CompletionRequest, request_id: str
    ) -> list[tuple[dict, SamplingParams]]:
        """(engine input, SamplingParams) for each prompt, checked as the engine
        would (blocking: run in the executor)."""
        prepared = []
        for i, engine_input in enumerate(self._prompts(request)):
            max_tokens = self._validate_prompt_len(
                engine_input["prompt_token_ids"], request.max_tokens
            )
            sampling_params = request.to_sampling_params(max_tokens)
            self._validate_engine_input(
                f"{request_id}-{i}",
                engine_input,
                sampling_params,
                self._maybe_get_adapters(request.model),
            )
            prepared.append((engine_input, sampling_params))
        return prepared

    async def create_completion(
        self, request: CompletionRequest
    ) -> AsyncGenerator[str, None] | CompletionResponse | ErrorResponse:
        if (error := self._check_model(request.model)) is not None:
            return error
        request_id = f"cmpl-{random_uuid()}"
        created_time = int(time.time())
        try:
            prepared = await make_async(self._prepare, self.executor)(request, request_id)
        except (ValueError, TypeError) as e:
            return self.create_error_response(e)
        output_kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        lora_request = self._maybe_get_adapters(request.model)
        generators = [
            self.engine_client.generate(
                engine_input,
                sampling_params,
                f"{request_id}-{i}",
                n=request.n,
                output_kind=output_kind,
                lora_request=lora_request,
            )
            for i, (engine_input, sampling_params) in enumerate(prepared)
        ]
        result_generator = merge_async_iterators(*generators)
        if request.stream:
            return self.completion_stream_generator(
                request,
                result_generator,
                request_id,
                created_time,
                self.model_name(lora_request),
                num_prompts=len(prepared),
            )
        final_res_batch: list[RequestOutput | None] = [None] * len(prepared)
        try:
            async for i, res in result_generator:
                final_res_batch[i] = res
        except (ValueError, TypeError) as e:
            return self.create_error_response(e)
        return self.request_output_to_completion_response(
            final_res_batch, request, request_id, created_time, self.model_name(lora_request)
        )

    async def completion_stream_generator(
        self,
        request: CompletionRequest,
        result_generator: AsyncIterator[tuple[int, RequestOutput]],
        request_id: str,
        created_time: int,
        model_name: str,
        num_prompts: int,
    ) -> AsyncGenerator[str, None]:
        num_choices = request.n
        previous_text_lens = [0] * num_choices * num_prompts
        previous_num_tokens = [0] * num_choices * num_prompts
        num_prompt_tokens = [0] * num_prompts
        # With return_token_ids: the (prompt index, choice) pairs that sent the prompt's ids.
        sent_prompt_ids: set[tuple[int, int]] = set()
        include_usage, include_continuous_usage = should_include_usage(request.stream_options)
        try:
            async for prompt_idx, res in result_generator:
                if res.prompt_token_ids is not None:
                    num_prompt_tokens[prompt_idx] = len(res.prompt_token_ids)
                for output in res.outputs:
                    # The prompt's ids go with a choice's first output, as upstream
                    # marks them sent before skipping an empty (chunked-prefill) one.
                    prompt_token_ids_to_return = None
                    choice = (prompt_idx, output.index)
                    if request.return_token_ids and choice not in sent_prompt_ids:
                        prompt_token_ids_to_return = res.prompt_token_ids
                        sent_prompt_ids.add(choice)
                    # BEGIN LAB 16.1: one SSE event for one new piece of one choice
                    # HINT: receives output (a delta: only what is new), prompt_idx, request and
                    # HINT: the running lists; yields at most one event and updates the lists.
                    # HINT: choice index = prompt_idx * n + output.index. Nothing at all for an
                    # HINT: output with no text, no tokens and none sent before (a chunked prefill).
                    # HINT: an event is "data: " + chunk.model_dump_json(exclude_unset=True) + a
                    # HINT: blank line; pass every choice field explicitly (exclude_unset keeps
                    # HINT: them). With request.return_token_ids: prompt_token_ids is
                    # HINT: prompt_token_ids_to_return and token_ids the output's, as a list;
                    # HINT: else both None.
                    # HINT: the system fingerprint rides on a choice's last chunk, only when no
                    # HINT: usage chunk will follow; continuous usage counts this choice's tokens.
                    i = output.index + prompt_idx * num_choices
                    if not output.text and not output.token_ids and not previous_num_tokens[i]:
                        continue  # a chunked prefill step: nothing to send yet
                    logprobs = None
                    if request.logprobs is not None:
                        logprobs = self._create_completion_logprobs(
                            output.token_ids,
                            output.logprobs,
                            request.logprobs,
                            initial_text_offset=previous_text_lens[i],
                        )
                    previous_text_lens[i] += len(output.text)
                    previous_num_tokens[i] += len(output.token_ids)
                    chunk = CompletionStreamResponse(
                        id=request_id,
                        object="text_completion",
                        created=created_time,
                        model=model_name,
                        choices=[
                            CompletionResponseStreamChoice(
                                index=i,
                                text=output.text,
                                logprobs=logprobs,
                                finish_reason=output.finish_reason,
                                stop_reason=output.stop_reason,
                                prompt_token_ids=prompt_token_ids_to_return,
                                token_ids=(
                                    list(output.token_ids) if request.return_token_ids else None
                                ),
                            )
                        ],
                    )
                    last = output.finish_reason is not None
                    if not include_usage and self.system_fingerprint is not None and last:
                        chunk.system_fingerprint = self.system_fingerprint
                    if include_continuous_usage:
                        prompt_tokens = num_prompt_tokens[prompt_idx]
                        chunk.usage = UsageInfo(
                            prompt_tokens=prompt_tokens,
                            completion_tokens=previous_num_tokens[i],
                            total_tokens=prompt_tokens + previous_num_tokens[i],
                        )
                    yield f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"
                    # END LAB 16.1
            # BEGIN LAB 16.1: the usage chunk, after every choice has finished
            # HINT: receives include_usage and the running counts; yields one event or none.
            # HINT: no choices, the usage summed over every prompt and choice, the system
            # HINT: fingerprint; dumped with exclude_none (not exclude_unset, as the others).
            if include_usage:
                total_prompt_tokens = sum(num_prompt_tokens)
                total_completion_tokens = sum(previous_num_tokens)
                usage_chunk = CompletionStreamResponse(
                    id=request_id,
                    created=created_time,
                    model=model_name,
                    choices=[],
                    usage=UsageInfo(
                        prompt_tokens=total_prompt_tokens,
                        completion_tokens=total_completion_tokens,
                        total_tokens=total_prompt_tokens + total_completion_tokens,
                    ),
                    system_fingerprint=self.system_fingerprint,
                )
                yield f"data: {usage_chunk.model_dump_json(exclude_none=True)}\n\n"
            # END LAB 16.1
        except Exception as e:
            yield f"data: {self.create_streaming_error_response(e)}\n\n"
        # BEGIN LAB 16.1: the end of the stream
        # HINT: receives nothing; yields the terminator event the OpenAI client stops on,
        # HINT: always, after an error event too.
        yield "data: [DONE]\n\n"
        # END LAB 16.1

    def request_output_to_completion_response(
        self,
        final_res_batch: list[RequestOutput],
        request: CompletionRequest,
        request_id: str,
        created_time: int,
        model_name: str,
    ) -> CompletionResponse:
        choices: list[CompletionResponseChoice] = []
        num_prompt_tokens = num_generated_tokens = 0
        for final_res in final_res_batch:
            for output in final_res.outputs:
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self._create_completion_logprobs(
                        output.token_ids, output.logprobs, request.logprobs
                    )
                choices.append(
                    CompletionResponseChoice(
                        index=len(choices),
                        text=output.text,
                        logprobs=logprobs,
                        finish_reason=output.finish_reason,
                        stop_reason=output.stop_reason,
                        token_ids=list(output.token_ids) if request.return_token_ids else None,
                        prompt_token_ids=(
                            final_res.prompt_token_ids if request.return_token_ids else None
                        ),
                    )
                )
                num_generated_tokens += len(output.token_ids)
            num_prompt_tokens += len(final_res.prompt_token_ids)
        return CompletionResponse(
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
            kv_transfer_params=final_res_batch[0].kv_transfer_params,
        )

    def _create_completion_logprobs(
        self,
        token_ids: list[int],
        top_logprobs: list[dict[int, float]],
        num_output_top_logprobs: int,
        initial_text_offset: int = 0,
    ) -> CompletionLogProbs:
        """Per token: its text, offset and logprob, and the top
        ``num_output_top_logprobs + 1`` (the sampled token comes first, as
        the OpenAI API has it). -inf becomes -9999.0, which JSON can carry."""
        text_offset: list[int] = []
        token_logprobs: list[float | None] = []
        tokens: list[str] = []
        out_top_logprobs: list[dict[str, float] | None] = []
        for step, token_id in enumerate(token_ids):
            step_top_logprobs = top_logprobs[step]
            tokens.append(self.tokenizer.decode([token_id]))
            token_logprobs.append(max(step_top_logprobs[token_id], -9999.0))
            out_top_logprobs.append(
                {
                    self.tokenizer.decode([top_id]): max(logprob, -9999.0)
                    for rank, (top_id, logprob) in enumerate(step_top_logprobs.items())
                    if num_output_top_logprobs >= rank
                }
            )
            if not text_offset:
                text_offset.append(initial_text_offset)
            else:
                text_offset.append(text_offset[-1] + len(tokens[-2]))
        return CompletionLogProbs(
            text_offset=text_offset,
            token_logprobs=token_logprobs,
            tokens=tokens,
            top_logprobs=out_top_logprobs,
        )
