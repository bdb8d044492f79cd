"""Turn EngineCore's token outputs into RequestOutputs with text and metrics.

Mirrors upstream ``vllm/v1/engine/output_processor.py`` (``OutputProcessor``
:417, ``process_outputs`` :576, ``RequestState`` :129,
``OutputProcessorOutput`` :110) at v0.22.1. Left out: streaming output kinds
(mini_vllm returns cumulative outputs), n > 1, prompt logprobs, stats
loggers, external/internal request-id mapping.

Stop strings: the detokenizer finds them; a request it finishes this way is
finished here (``finish_reason="stop"``, ``stop_reason`` = the string) while
EngineCore still thinks it runs, so ``process_outputs`` returns its id in
``reqs_to_abort`` and ``LLMEngine.step`` aborts it in EngineCore, which frees
its KV blocks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from mini_vllm.engine import EngineCoreOutputs, FinishReason
from mini_vllm.engine.detokenizer import IncrementalDetokenizer
from mini_vllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from mini_vllm.sampling_params import SamplingParams


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput] = field(default_factory=list)
    # Finished here by a stop string but still running in EngineCore.
    reqs_to_abort: list[str] = field(default_factory=list)


class RequestState:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        tokenizer,
        arrival_time: float,
        params: SamplingParams,
    ) -> None:
        want_logprobs = params.logprobs is not None
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.detokenizer = (
            IncrementalDetokenizer(tokenizer, prompt_token_ids, params=params)
            if tokenizer is not None
            else None
        )
        self.logprobs: list[dict[int, float]] | None = [] if want_logprobs else None
        self.cumulative_logprob: float | None = 0.0 if want_logprobs else None
        self.metrics = RequestMetrics(arrival_time=arrival_time)

    def make_output(self, finish_reason: str | None, stop_reason) -> RequestOutput:
        finished = finish_reason is not None
        text = (
            self.detokenizer.get_next_output_text(finished) if self.detokenizer is not None else ""
        )
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(self.output_token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
        )
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            [completion],
            finished=finished,
            metrics=self.metrics,
        )


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        arrival_time: float,
        params: SamplingParams,
    ) -> None:
        self.request_states[request_id] = RequestState(
            request_id, prompt, prompt_token_ids, self.tokenizer, arrival_time, params
        )

    def abort_requests(self, request_ids) -> list[str]:
        """Forget these requests; return the ids that were still known."""
        return [
            request_id
            for request_id in request_ids
            if self.request_states.pop(request_id, None) is not None
        ]

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def process_outputs(self, engine_core_outputs: EngineCoreOutputs) -> OutputProcessorOutput:
        now = time.time()
        results = OutputProcessorOutput()
        for out in engine_core_outputs.outputs:
            state = self.request_states.get(out.request_id)
            if state is None:
                continue  # aborted meanwhile
            if out.new_token_ids and state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            state.output_token_ids.extend(out.new_token_ids)
            state.metrics.num_generation_tokens = len(state.output_token_ids)
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            if state.detokenizer is not None:
                stop_string = state.detokenizer.update(
                    out.new_token_ids, finish_reason == FinishReason.STOP
                )
                if stop_string:
                    finish_reason, stop_reason = FinishReason.STOP, stop_string
            if state.logprobs is not None and out.new_logprobs:
                for ids, vals, _rank in out.new_logprobs:
                    state.logprobs.append(dict(zip(ids, vals, strict=True)))
                    state.cumulative_logprob += vals[0]
            finish_reason = str(finish_reason) if finish_reason is not None else None
            output = state.make_output(finish_reason, stop_reason)
            output.kv_transfer_params = out.kv_transfer_params
            results.request_outputs.append(output)
            if finish_reason is not None:
                state.metrics.finished_time = now
                del self.request_states[out.request_id]
                if not out.finished:
                    # Stopped by a stop string: EngineCore must abort it.
                    results.reqs_to_abort.append(out.request_id)
        return results
