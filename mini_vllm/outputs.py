"""What flows out: the model runner's output, and what a user gets back.

Mirrors upstream ``vllm/v1/outputs.py`` (``KVConnectorOutput`` :195,
``ModelRunnerOutput`` :233, ``DraftTokenIds`` :297) and
``CompletionOutput`` (vllm/outputs.py:22), ``RequestOutput``
(vllm/outputs.py:85) at v0.22.1. Left out: pooling, connector stats and events,
NaN counts, CUDA-graph stats, n > 1, prompt logprobs, multimodal and LoRA fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KVConnectorOutput:
    """What the worker half of a KV connector reports after a step."""

    # Requests whose asynchronous save / send ended (their blocks may go).
    finished_sending: set[str] | None = None
    # Requests whose asynchronous load ended (they may be scheduled).
    finished_recving: set[str] | None = None
    # Externally loaded blocks that failed: their tokens must be recomputed
    # (or the request failed, by kv_load_failure_policy).
    invalid_block_ids: set[int] = field(default_factory=set)
    # mini only: get_finished raised this step, so nothing above says which
    # transfers ended (upstream's engine dies instead). The scheduler gives
    # up on a transfer after MAX_GET_FINISHED_FAILURES such steps in a row.
    get_finished_failed: bool = False

    def is_empty(self) -> bool:
        return (
            not self.finished_sending
            and not self.finished_recving
            and not self.invalid_block_ids
            and not self.get_finished_failed
        )


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    # One list per request: the tokens sampled this step. Empty for a
    # request whose prompt is still being prefilled; with drafts, the
    # accepted drafts then one token of the target's own.
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    # Optional per-request top-n logprobs (filled by the sampler).
    logprobs: list | None = None
    # The KV connector's report (None without a connector).
    kv_connector_output: KVConnectorOutput | None = None


@dataclass
class DraftTokenIds:
    """The drafts the proposer made after a step, for the scheduler's
    ``update_draft_token_ids``: one list per request (maybe empty)."""

    req_ids: list[str]
    draft_token_ids: list[list[int]]


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={})


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of one request's life."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    # Per generated token: {token id: logprob} for the sampled token and the top-n.
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # P/D: the KV connector's parameters for the next engine (Phase 15).
    kv_transfer_params: dict | None = None
