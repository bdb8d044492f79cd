"""Turn EngineCore's token outputs into RequestOutputs with text and metrics.

Mirrors upstream ``vllm/v1/engine/output_processor.py`` (``OutputProcessor``
:417, ``process_outputs`` :576, ``RequestState`` :129,
``OutputProcessorOutput`` :110) at v0.22.1. Left out: streaming output kinds
(mini_vllm returns cumulative outputs), n > 1, prompt logprobs, LoRA request
states, external/internal request-id mapping.

Statistics (Phase 18), as upstream (``_update_stats_from_output`` :774,
``_update_stats_from_finished`` :795): with ``log_stats`` each request keeps
a ``RequestStateStats``, and ``process_outputs`` given an ``IterationStats``
adds every output's tokens, latencies and events to it, and each finished
request's intervals. ``process_outputs`` takes the whole ``EngineCoreOutputs``
(upstream: its ``outputs`` list and its ``timestamp`` apart).

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
from mini_vllm.metrics.stats import IterationStats, RequestStateStats
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
        log_stats: bool = False,
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
        # For the Prometheus metrics (upstream: output_processor.py:172-176).
        self.max_tokens_param = params.max_tokens
        self.is_prefilling = True
        self.num_cached_tokens = 0
        self.stats = RequestStateStats(arrival_time=arrival_time) if log_stats else None

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
    def __init__(self, tokenizer, log_stats: bool = False) -> None:
        self.tokenizer = tokenizer
        self.log_stats = log_stats
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
            request_id,
            prompt,
            prompt_token_ids,
            self.tokenizer,
            arrival_time,
            params,
            log_stats=self.log_stats,
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

    def process_outputs(
        self,
        engine_core_outputs: EngineCoreOutputs,
        iteration_stats: IterationStats | None = None,
    ) -> OutputProcessorOutput:
        now = time.time()
        results = OutputProcessorOutput()
        for out in engine_core_outputs.outputs:
            state = self.request_states.get(out.request_id)
            if state is None:
                continue  # aborted meanwhile
            if iteration_stats is not None and state.stats is not None:
                iteration_stats.update_from_output(
                    out, engine_core_outputs.timestamp, state.is_prefilling, state.stats
                )
            if state.is_prefilling:
                if out.prefill_stats is not None:
                    state.num_cached_tokens = out.prefill_stats.num_cached_tokens
                state.is_prefilling = False
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
            reason = str(finish_reason) if finish_reason is not None else None
            output = state.make_output(reason, stop_reason)
            output.kv_transfer_params = out.kv_transfer_params
            results.request_outputs.append(output)
            if reason is not None:
                state.metrics.finished_time = now
                del self.request_states[out.request_id]
                if not out.finished:
                    # Stopped by a stop string: EngineCore must abort it.
                    results.reqs_to_abort.append(out.request_id)
                if iteration_stats is not None and state.stats is not None:
                    self._update_stats_from_finished(state, finish_reason, iteration_stats)
        return results

    @staticmethod
    def _update_stats_from_finished(
        state: RequestState, finish_reason: FinishReason, iteration_stats: IterationStats
    ) -> None:
        """A finished request's intervals, and its n and output length (n is 1
        here: each of AsyncLLM's child requests counts as a request)."""
        iteration_stats.update_from_finished_request(
            finish_reason=finish_reason,
            request_id=state.request_id,
            num_prompt_tokens=len(state.prompt_token_ids),
            max_tokens_param=state.max_tokens_param,
            req_stats=state.stats,
            num_cached_tokens=state.num_cached_tokens,
        )
        iteration_stats.max_num_generation_tokens_iter.append(state.stats.num_generation_tokens)
        iteration_stats.n_params_iter.append(1)
