"""What the scheduler hands the model runner each step.

Mirrors upstream ``vllm/v1/core/sched/output.py`` at v0.22.1
(``NewRequestData`` :31, ``CachedRequestData`` :112, ``SchedulerOutput``
:181, ``GrammarOutput`` :259). Left out: pooling and
the encoder-cache connector's fields, and the grammar fields of async scheduling
(``pending_structured_output_tokens``, ``num_invalid_spec_tokens``).

The split is the point: a request scheduled for the first time travels in
full (``NewRequestData``: prompt, sampling params, all its block ids); after
that only deltas travel (``CachedRequestData``: new block ids, computed
count). A request resumed after preemption lost its blocks, so its
``new_block_ids`` *replace* its block table instead of extending it, and its
whole token list is resent in ``all_token_ids``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mini_vllm.lora.request import LoRARequest
from mini_vllm.multimodal.inputs import MultiModalFeatureSpec
from mini_vllm.request import Request
from mini_vllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    # The adapter the runner applies to this request's rows (None: base model).
    lora_request: LoRARequest | None = None
    # Its multimodal items (upstream's field sits after prompt_token_ids; here
    # it has a default, at the end, so text-only callers still work).
    mm_features: list[MultiModalFeatureSpec] = field(default_factory=list)
    # A prompt given as embeddings [num_prompt_tokens, hidden] (Phase 13), or None.
    prompt_embeds: Any = None

    @classmethod
    def from_request(cls, request: Request, block_ids: tuple[list[int], ...]) -> NewRequestData:
        return cls(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            block_ids=block_ids,
            num_computed_tokens=request.num_computed_tokens,
            lora_request=request.lora_request,
            mm_features=request.mm_features,
            prompt_embeds=request.prompt_embeds,
        )


@dataclass
class CachedRequestData:
    req_ids: list[str]
    # For these ids new_block_ids replace the block table (resumed requests).
    resumed_req_ids: set[str]
    # Upstream fills this only under pipeline parallelism; without it the
    # model runner keeps the tokens it sampled, so it stays empty here too.
    new_token_ids: list[list[int]]
    # Full token lists for requests not scheduled in the previous step.
    all_token_ids: dict[str, list[int]]
    new_block_ids: list[tuple[list[int], ...] | None]
    num_computed_tokens: list[int]
    num_output_tokens: list[int]

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @classmethod
    def make_empty(cls) -> CachedRequestData:
        return cls([], set(), [], {}, [], [], [])


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> tokens scheduled this step, in scheduling order.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Leading blocks shared by all requests holding blocks (one per group).
    num_common_prefix_blocks: list[int]
    # Requests that finished since the previous schedule() (workers free state).
    finished_req_ids: set[str]
    preempted_req_ids: set[str] = field(default_factory=set)
    # req_id -> the drafts to verify this step (a request without drafts is
    # absent). Its num_scheduled_tokens count them: 1 + len(drafts) for a
    # decoding request. (Upstream's field sits after total_num_scheduled_tokens;
    # here it has a default, at the end, so pre-speculation callers still work.)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Whether a scheduled request with a grammar samples a token this step
    # (set by _update_after_schedule; get_grammar_bitmask reads it).
    has_structured_output_requests: bool = False
    # The KV connector's plan for this step (build_connector_meta), for the
    # workers' half of the connector; None without a connector.
    kv_connector_metadata: Any = None
    # req_id -> indices of its mm_features the encoder runs this step (e.g.
    # [0, 1]: its first two images); their outputs enter the encoder cache.
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    # Identifiers of encoder outputs evicted this step: the runner drops them.
    free_encoder_mm_hashes: list[str] = field(default_factory=list)

    @classmethod
    def make_empty(cls) -> SchedulerOutput:
        return cls([], CachedRequestData.make_empty(), {}, 0, [], set())


@dataclass
class GrammarOutput:
    """The step's grammar bitmask, for the runner to apply before sampling."""

    # The structured requests that sample this step, in scheduled order.
    structured_output_request_ids: list[str]
    # int32 numpy [sum of (1 + drafts) over those requests, ceil(vocab / 32)],
    # rows in the order of structured_output_request_ids.
    grammar_bitmask: np.ndarray
