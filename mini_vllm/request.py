"""A request and its lifecycle states.

Mirrors upstream ``vllm/v1/request.py`` at v0.22.1 (``Request`` at :59,
``RequestStatus`` at :315).
What is left out, and every deliberate difference: UPSTREAM_PIN.md.

Invariants kept:
- ``num_tokens == num_prompt_tokens + num_output_tokens``;
- ``0 <= num_computed_tokens <= num_tokens + num_output_placeholders``
  between steps (placeholders are 0 without async scheduling);
- ``block_hashes`` holds one hash per *full* block of ``all_token_ids``
  when the request has a block hasher (recomputed incrementally);
- the enum order is the logic: every status after ``PREEMPTED`` is finished.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from mini_vllm.engine import EngineCoreEvent, EngineCoreEventType, FinishReason
from mini_vllm.metrics.stats import PrefillStats
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.structured_output.request import StructuredOutputRequest

if TYPE_CHECKING:
    import torch

    from mini_vllm.core.kv_cache_utils import BlockHash
    from mini_vllm.lora.request import LoRARequest
    from mini_vllm.multimodal.inputs import MultiModalFeatureSpec


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        block_hasher: Callable[[Request], list[BlockHash]] | None = None,
        lora_request: LoRARequest | None = None,
        mm_features: list[MultiModalFeatureSpec] | None = None,
        prompt_embeds: torch.Tensor | None = None,
    ) -> None:
        if sampling_params is None:
            raise ValueError("sampling_params must be set")
        self.request_id = request_id
        self.priority = priority
        # The adapter this request runs with (None: the base model); its name
        # enters every block hash, so adapters never share cached KV.
        self.lora_request = lora_request
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.status = RequestStatus.WAITING
        # Set when the request carries a constraint; it then waits for its
        # grammar to compile before it can be scheduled (vllm/v1/request.py:87, :111).
        self.structured_output_request = StructuredOutputRequest.from_sampling_params(
            sampling_params
        )
        if self.structured_output_request is not None:
            self.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
        self.stop_reason: int | str | None = None
        # P/D (Phase 15): the KV connector's parameters for this request, from
        # ``extra_args["kv_transfer_params"]`` (vllm/v1/request.py:101-117).
        self.kv_transfer_params: dict | None = None
        if sampling_params.extra_args is not None:
            self.kv_transfer_params = sampling_params.extra_args.get("kv_transfer_params")
        if sampling_params.max_tokens is None:
            # Upstream's engine fills it (max_model_len - prompt length)
            # before it builds the Request; so must whoever builds one here.
            raise ValueError("sampling_params.max_tokens must be set before building a Request")
        self.max_tokens = sampling_params.max_tokens

        self.prompt_token_ids = list(prompt_token_ids)
        # A prompt given as embeddings [num_prompt_tokens, hidden] (upstream's
        # prompt_embeds, vllm/v1/request.py:122); its token ids are then zeros.
        self.prompt_embeds = prompt_embeds
        # Its blocks' embedding hashes, computed once (block range -> sha256).
        self._prompt_embeds_per_block_hashes: dict[tuple[int, int], bytes] = {}
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = self.prompt_token_ids.copy()
        self.spec_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # True while the last schedule() left part of the prompt uncomputed.
        self.is_prefill_chunk = False
        self.num_preemptions = 0
        # For the metrics (Phase 18): the events not yet handed out with an
        # output, and the first prefill's token sources (None once handed out).
        self.events: list[EngineCoreEvent] = []
        self.prefill_stats: PrefillStats | None = PrefillStats()
        # Async scheduling (core/sched/async_scheduler.py): tokens scheduled
        # whose sampled ids are not back yet, and stale in-flight outputs to
        # drop after reset_prefix_cache preempted the request. 0 when sync.
        self.num_output_placeholders = 0
        self.async_tokens_to_discard = 0
        # Upstream exposes read-only views (ConstantList); tuples would copy on
        # every access, so mini_vllm hands out the lists and trusts callers.
        self.output_token_ids = self._output_token_ids
        self.all_token_ids = self._all_token_ids

        # One feature per multimodal item, in prompt order (vllm/v1/request.py:149).
        # Set before the block hasher runs: the items' hashes enter block hashes.
        self.mm_features: list[MultiModalFeatureSpec] = list(mm_features or [])

        self.block_hashes: list[BlockHash] = []
        self._block_hasher = block_hasher
        self.update_block_hashes()

    # BEGIN LAB 01.1: a request's token bookkeeping and its finished state
    # mirrors vllm/v1/request.py:216-227
    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        """Record newly sampled token(s): one id or a list of ids.

        They are outputs and also part of the whole sequence, and any block
        they fill up must get its hash (prefix caching looks blocks up by it).
        """
        # HINT: two lists grow (self._output_token_ids, self._all_token_ids);
        # HINT: then self.update_block_hashes().
        if isinstance(token_ids, int):
            self._output_token_ids.append(token_ids)
            self._all_token_ids.append(token_ids)
        else:
            self._output_token_ids.extend(token_ids)
            self._all_token_ids.extend(token_ids)
        self.update_block_hashes()

    # END LAB 01.1

    def update_block_hashes(self) -> None:
        """Hash any block that became full since the last call."""
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    # BEGIN LAB 01.1: num_tokens: prompt plus output tokens
    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        return len(self._all_token_ids)

    # END LAB 01.1

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self._all_token_ids) + len(self.spec_token_ids)

    @property
    def use_structured_output(self) -> bool:
        return self.structured_output_request is not None

    # mirrors vllm/v1/request.py:250-256, :277-279
    @property
    def num_encoder_inputs(self) -> int:
        """How many multimodal items (images) the request carries."""
        return len(self.mm_features)

    @property
    def has_encoder_inputs(self) -> bool:
        return len(self.mm_features) > 0

    def get_num_encoder_embeds(self, input_id: int) -> int:
        """Encoder embeddings item ``input_id`` fills (its encoder output rows)."""
        assert input_id < len(self.mm_features)
        return self.mm_features[input_id].mm_position.get_num_embeds()

    # BEGIN LAB 01.1: num_output_tokens: tokens sampled so far
    @property
    def num_output_tokens(self) -> int:
        """Tokens sampled so far (a resumed request keeps its earlier ones)."""
        return len(self._output_token_ids)

    # END LAB 01.1

    # BEGIN LAB 01.1: is_finished: the status says it
    def is_finished(self) -> bool:
        """Whether the request's status is one of the FINISHED_* statuses."""
        # HINT: RequestStatus has a staticmethod for this (the enum order is the logic).
        return RequestStatus.is_finished(self.status)

    # END LAB 01.1

    # BEGIN LAB 01.1: get_finished_reason: the status, as a FinishReason
    def get_finished_reason(self) -> FinishReason | None:
        """STOP, LENGTH or ABORT for a finished request; None for a live one."""
        return RequestStatus.get_finished_reason(self.status)

    # END LAB 01.1

    def record_event(self, event_type: EngineCoreEventType, timestamp: float | None = None) -> None:
        self.events.append(EngineCoreEvent.new_event(event_type, timestamp))

    def take_events(self) -> list[EngineCoreEvent] | None:
        """The events since the last call (None if there are none), then forget them."""
        if not self.events:
            return None
        events, self.events = self.events, []
        return events

    def take_prefill_stats(self) -> PrefillStats | None:
        """The first prefill's stats, once (None afterwards)."""
        prefill_stats, self.prefill_stats = self.prefill_stats, None
        return prefill_stats

    def __lt__(self, other: Request) -> bool:
        """Order used by the PRIORITY queue: priority, arrival, then id."""
        if self.priority != other.priority:
            return self.priority < other.priority
        if self.arrival_time != other.arrival_time:
            return self.arrival_time < other.arrival_time
        if self.request_id != other.request_id:
            return self.request_id < other.request_id
        return id(self) < id(other)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )


# mirrors vllm/v1/request.py:315-342
class RequestStatus(enum.IntEnum):
    """Where a request is in its life. Order matters: see ``is_finished``.

    All of upstream's members, in upstream's order. mini_vllm's scheduler
    sets WAITING, WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR (a request with a
    constraint, until its grammar compiles), RUNNING, PREEMPTED, the first
    three FINISHED_* and FINISHED_ERROR (a grammar that failed or refused a
    token): the others belong to features it leaves out (KV transfer,
    streaming input, repetition detection).
    """

    WAITING = enum.auto()
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    WAITING_FOR_STREAMING_REQ = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything below PREEMPTED is a finished status.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()
    FINISHED_REPETITION = enum.auto()

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISHED_REASON_MAP.get(status)


_FINISHED_REASON_MAP = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    # A prompt longer than the model's length cap: "length", as OpenAI's API says.
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
    RequestStatus.WAITING_FOR_STREAMING_REQ: FinishReason.STOP,
    RequestStatus.FINISHED_REPETITION: FinishReason.REPETITION,
}
