"""What EngineCore hands back to the front end after each step.

Mirrors upstream ``vllm/v1/engine/__init__.py`` at v0.22.1 (``FinishReason``
:42, ``EngineCoreOutput`` :168, ``EngineCoreOutputs`` :213). Left out: msgspec
serialization, events, logprob tensors, pooling fields, and
the per-client dict (mini_vllm has one client).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mini_vllm.metrics.stats import SchedulerStats


class FinishReason(enum.IntEnum):
    """Why a request finished; ``str()`` gives the OpenAI-style word."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    REPETITION = 4

    def __str__(self) -> str:
        return self.name.lower()


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    new_logprobs: object | None = None
    # P/D: what the KV connector returned from request_finished (Phase 15).
    kv_transfer_params: dict | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
