"""What a structured-output backend and its per-request grammar must do.

Mirrors upstream ``vllm/v1/structured_output/backend_types.py`` at v0.22.1
(``StructuredOutputOptions`` :19, ``StructuredOutputGrammar`` :31,
``StructuredOutputBackend`` :99). mini_vllm has one backend, xgrammar
(``backend_xgrammar.py``); the interface is kept so that the scheduler and
the manager read as upstream's do. Left out: the structural-tag kind (its
member stays, nothing builds it). See UPSTREAM_PIN.md.

Invariants kept:
- a grammar's state moves only through ``accept_tokens`` and ``rollback``;
  ``validate_tokens`` and ``fill_bitmask`` leave it where it was;
- ``is_terminated`` is true once the grammar has accepted a complete output
  (for xgrammar: the stop token after a complete match).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


class StructuredOutputOptions(enum.Enum):
    JSON = enum.auto()
    JSON_OBJECT = enum.auto()
    REGEX = enum.auto()
    GRAMMAR = enum.auto()
    CHOICE = enum.auto()
    STRUCTURAL_TAG = enum.auto()


# (kind, its text): the grammar a request asks for, as compiled.
StructuredOutputKey = tuple[StructuredOutputOptions, str]


class StructuredOutputGrammar(ABC):
    """One request's matcher: where it is in its grammar."""

    @abstractmethod
    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        """Advance over ``tokens``; False (and stop there) at the first one the grammar refuses."""

    @abstractmethod
    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """The longest prefix of ``tokens`` the grammar accepts; the state does not move."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, batch_index: int) -> None:
        """Write the allowed next tokens into row ``batch_index`` of ``bitmask``."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether the grammar has accepted a complete output."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the grammar's start."""


@dataclass
class StructuredOutputBackend(ABC):
    """Engine-wide: compiles grammars against one tokenizer's vocabulary."""

    vllm_config: Any
    tokenizer: Any
    vocab_size: int

    @abstractmethod
    def compile_grammar(
        self, request_type: StructuredOutputOptions, grammar_spec: str
    ) -> StructuredOutputGrammar:
        """A fresh matcher for the grammar ``grammar_spec`` of kind ``request_type``."""

    @abstractmethod
    def allocate_token_bitmask(self, max_num_seqs: int) -> torch.Tensor:
        """An int32 bitmask of ``max_num_seqs`` rows, one bit per vocabulary token."""

    @abstractmethod
    def destroy(self) -> None:
        """Release what the backend holds."""
