"""Turn EngineCore's token outputs into RequestOutputs with text and metrics.

Mirrors upstream ``vllm/v1/engine/output_processor.py`` (``OutputProcessor``
:417, ``RequestState`` :129) at v0.22.1. Left out: streaming output kinds (mini_vllm
returns cumulative outputs), n > 1, stop strings, prompt logprobs, stats
loggers.
"""

from __future__ import annotations

import time

from mini_vllm.engine import EngineCoreOutputs
from mini_vllm.engine.detokenizer import IncrementalDetokenizer
from mini_vllm.outputs import CompletionOutput, RequestMetrics, RequestOutput


class RequestState:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 tokenizer, arrival_time: float, want_logprobs: bool) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.detokenizer = (IncrementalDetokenizer(tokenizer, prompt_token_ids)
                            if tokenizer is not None else None)
        self.logprobs: list[dict[int, float]] | None = [] if want_logprobs else None
        self.cumulative_logprob: float | None = 0.0 if want_logprobs else None
        self.metrics = RequestMetrics(arrival_time=arrival_time)

    def make_output(self, finish_reason: str | None, stop_reason) -> RequestOutput:
        text = self.detokenizer.output_text if self.detokenizer is not None else ""
        completion = CompletionOutput(
            index=0, text=text, token_ids=list(self.output_token_ids),
            cumulative_logprob=self.cumulative_logprob, logprobs=self.logprobs,
            finish_reason=finish_reason, stop_reason=stop_reason)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [completion],
                             finished=finish_reason is not None, metrics=self.metrics)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    arrival_time: float, want_logprobs: bool) -> None:
        self.request_states[request_id] = RequestState(
            request_id, prompt, prompt_token_ids, self.tokenizer, arrival_time, want_logprobs)

    def abort_requests(self, request_ids) -> None:
        for request_id in request_ids:
            self.request_states.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def process_outputs(self, engine_core_outputs: EngineCoreOutputs) -> list[RequestOutput]:
        now = time.time()
        results = []
        for out in engine_core_outputs.outputs:
            state = self.request_states.get(out.request_id)
            if state is None:
                continue  # aborted meanwhile
            if out.new_token_ids and state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            state.output_token_ids.extend(out.new_token_ids)
            state.metrics.num_generation_tokens = len(state.output_token_ids)
            if state.detokenizer is not None:
                state.detokenizer.update(out.new_token_ids)
            if state.logprobs is not None and out.new_logprobs:
                for ids, vals, _rank in out.new_logprobs:
                    state.logprobs.append(dict(zip(ids, vals)))
                    state.cumulative_logprob += vals[0]
            finish_reason = str(out.finish_reason) if out.finish_reason is not None else None
            if finish_reason is not None:
                state.metrics.finished_time = now
                del self.request_states[out.request_id]
            results.append(state.make_output(finish_reason, out.stop_reason))
        return results
