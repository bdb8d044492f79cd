"""What EngineCore hands back to the front end after each step.

Mirrors upstream ``vllm/v1/engine/__init__.py`` at v0.22.1 (``FinishReason``
:42, ``EngineCoreEventType`` :141, ``EngineCoreEvent`` :149,
``EngineCoreOutput`` :168, ``EngineCoreOutputs`` :213). Left out: msgspec
serialization, logprob tensors, pooling fields, and the per-client dict
(mini_vllm has one client).

``EngineCoreOutput`` is a msgspec ``Struct`` with ``gc=False``, as upstream's:
the scheduler builds one per request per step, and a Struct is built in C
(0.08 us here, against 0.47 us for a dataclass with these eight fields).

Events and timestamps feed the metrics (Phase 18): the scheduler records a
request's QUEUED, SCHEDULED and PREEMPTED events on the request and hands
them out with its next output; ``EngineCoreOutputs.timestamp`` is when the
step's outputs were made. Both are ``time.monotonic()``, comparable only
with each other (the front end's arrival time is wall-clock).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from mini_vllm.metrics.stats import PrefillStats, SchedulerStats


class FinishReason(enum.IntEnum):
    """Why a request finished; ``str()`` gives the OpenAI-style word."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    REPETITION = 4

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreEventType(enum.IntEnum):
    """What happened to a request in the engine core."""

    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


@dataclass
class EngineCoreEvent:
    """One event of a request, with its ``time.monotonic()`` timestamp."""

    type: EngineCoreEventType
    timestamp: float

    @classmethod
    def new_event(
        cls, event_type: EngineCoreEventType, timestamp: float | None = None
    ) -> EngineCoreEvent:
        return cls(event_type, time.monotonic() if timestamp is None else timestamp)


class EngineCoreOutput(msgspec.Struct, gc=False):
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    new_logprobs: object | None = None
    # P/D: what the KV connector returned from request_finished (Phase 15).
    kv_transfer_params: dict | None = None
    # The request's events since its last output (None: none, or stats off).
    events: list[EngineCoreEvent] | None = None
    # With its first output: where its prompt's tokens came from.
    prefill_stats: PrefillStats | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    # When the outputs were made (time.monotonic(); 0.0 given means now).
    timestamp: float = 0.0

    def __post_init__(self) -> None:
        if self.timestamp == 0.0:
            self.timestamp = time.monotonic()
