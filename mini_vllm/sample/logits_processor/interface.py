"""The logits-processor API: a processor sees the batch change, then the logits.

Mirrors upstream ``vllm/v1/sample/logits_processor/interface.py``
(``MoveDirectionality`` :17, ``BatchUpdate`` :37, ``LogitsProcessor`` :60)
at v0.22.1.

A processor keeps per-row state (row = the request's index in the
persistent batch). Before every forward pass the batch calls
``update_state`` with a ``BatchUpdate`` listing what changed since the last
call, or ``None`` when nothing did; then the sampler calls ``apply`` on the
logits of the rows ``0 .. batch_size - 1``.

A ``BatchUpdate`` holds:
- ``removed``: rows whose request left;
- ``added``: ``(row, params, prompt token ids, output token ids)``; the
  output list is the request's live list, so a processor that keeps it sees
  every token generated later; an added row may reuse a row that held
  another request;
- ``moved``: ``(a, b, directionality)``: ``SWAP`` exchanges rows a and b;
  ``UNIDIRECTIONAL`` moves a's request to b (the batch condensing), leaving
  a empty and replacing whatever b held.
Upstream's comment says to process removed, added, moved in that order; its
built-ins process added first, then removed, then moved, in list order.
The persistent batch never lists a row as both removed and added (a new
request takes a removed row off the removed list), so the two orders agree
on what it produces.

``is_argmax_invariant`` says whether a processor can change a greedy pick:
the sampler runs the ones that can (min_tokens, logit_bias) before the
penalties, and the ones that cannot (min_p) after temperature, and only when
some row samples at random (a greedy row's token is the argmax taken
before them).

Differences (see UPSTREAM_PIN.md): the config passed to ``__init__`` is
mini_vllm's ``VllmConfig``, and processors read the request's parameters by
attribute (``min_p``, ``logit_bias``, ``min_tokens``,
``all_stop_token_ids``), so any object with those attributes will do.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from mini_vllm.config import VllmConfig


class MoveDirectionality(Enum):
    UNIDIRECTIONAL = auto()  # a's request moves to b; a is left empty
    SWAP = auto()  # a's and b's requests trade rows


RemovedRequest = int
# (row, SamplingParams, prompt token ids or None, live output token ids)
AddedRequest = tuple[int, Any, "list[int] | None", "list[int]"]
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    """What changed in the persistent batch since the last update."""

    batch_size: int  # number of requests in the batch after the change
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        """Raise ValueError if a request's parameters are invalid for this processor."""
        return None

    @abstractmethod
    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Process float32 [batch_size, V] logits; may write in place; returns them."""
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if ``apply`` can never change which token has the largest logit."""
        raise NotImplementedError

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called before every forward pass; ``batch_update`` is None if the batch is unchanged."""
        raise NotImplementedError
