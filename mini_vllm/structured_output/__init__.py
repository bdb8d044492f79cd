"""The engine's structured-output manager: compile grammars off the step path, build the bitmask.

Mirrors upstream ``vllm/v1/structured_output/__init__.py`` at v0.22.1
(``StructuredOutputManager`` :36: ``grammar_init`` :115, ``_create_grammar``
:173, ``_fill_bitmasks`` :186, ``grammar_bitmask`` :204,
``should_fill_bitmask`` :302, ``should_advance`` :322). Left out: the other
backends (guidance, outlines, lm-format-enforcer: xgrammar only), reasoning
parsers (so ``should_fill_bitmask`` and ``should_advance`` reduce to "has a
grammar"), the thread pool that fills bitmasks of batches over 128 requests
in parallel (the rows come out the same), and the synchronous compile of
the ``external_launcher`` executor. See UPSTREAM_PIN.md.

How a structured request flows:
1. ``EngineCore.add_request`` calls ``grammar_init``: the compile is
   submitted to a thread pool and the request holds its future; the request
   was created in WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR, and the scheduler
   skips it until the future is done;
2. each step, ``Scheduler.get_grammar_bitmask`` asks ``grammar_bitmask`` for
   one row per structured request that samples this step (plus one per
   draft it verifies), in scheduled order; the runner applies it;
3. ``Scheduler.update_from_output`` feeds the sampled tokens to the
   request's grammar (``accept_tokens``), and a request whose grammar
   terminated stops with the stop token that ended it.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch

from mini_vllm.structured_output.backend_types import (
    StructuredOutputBackend,
    StructuredOutputGrammar,
)
from mini_vllm.structured_output.backend_xgrammar import XgrammarBackend

if TYPE_CHECKING:
    from mini_vllm.config import VllmConfig
    from mini_vllm.request import Request


class StructuredOutputManager:
    """Engine-level manager for structured output requests."""

    def __init__(
        self, vllm_config: VllmConfig, tokenizer=None, vocab_size: int | None = None
    ) -> None:
        """``tokenizer``: the model's Hugging Face tokenizer (None: structured
        requests are refused); ``vocab_size``: the model's (its logits' width)."""
        self.backend: StructuredOutputBackend | None = None
        self.vllm_config = vllm_config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._grammar_bitmask: torch.Tensor | None = None
        self._full_mask = torch.tensor(-1, dtype=torch.int32)
        # Compiles are CPU-bound: half the cores, as upstream (__init__.py:77).
        max_workers = max(1, ((os.cpu_count() or 1) + 1) // 2)
        self.executor = ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="mini_vllm_grammar"
        )

    def grammar_init(self, request: Request) -> None:
        """Start compiling the request's grammar; the request holds the future."""
        if request.structured_output_request is None:
            return
        if self.backend is None:
            if self.tokenizer is None:
                raise ValueError(
                    "Structured outputs requires a tokenizer, and this engine has none."
                )
            vocab_size = self.vocab_size or len(self.tokenizer)
            self.backend = XgrammarBackend(
                self.vllm_config, tokenizer=self.tokenizer, vocab_size=vocab_size
            )
        grammar = self.executor.submit(self._create_grammar, request)
        request.structured_output_request.grammar = grammar

    def _create_grammar(self, request: Request) -> StructuredOutputGrammar:
        request_type, grammar_spec = request.structured_output_request.structured_output_key
        assert self.backend is not None
        return self.backend.compile_grammar(request_type, grammar_spec)

    # BEGIN LAB 12.2: fill one row: the grammar's allowed tokens, or all ones
    def _fill_bitmasks(self, batch: Iterable[tuple[StructuredOutputGrammar, int, bool]]) -> None:
        """Each (grammar, row, apply): the grammar's allowed tokens, or all
        ones for a row not to constrain (a terminated grammar, a padding draft)."""
        # HINT: grammar.fill_bitmask(self._grammar_bitmask, index) writes a row;
        # HINT: self._full_mask is the int32 -1 (all 32 bits set).
        assert self._grammar_bitmask is not None
        for grammar, index, apply_bitmask in batch:
            if apply_bitmask and not grammar.is_terminated():
                grammar.fill_bitmask(self._grammar_bitmask, index)
            else:
                self._grammar_bitmask[index].fill_(self._full_mask)

    # END LAB 12.2

    def grammar_bitmask(
        self,
        requests: dict[str, Request],
        structured_output_request_ids: list[str],
        scheduled_spec_decode_tokens: dict[str, list[int]],
    ) -> np.ndarray | None:
        """int32 [rows, ceil(vocab / 32)]: for each request in order, one row
        per draft it verifies, then one for the token after them.

        The row for draft ``i`` is the mask after drafts ``0..i-1``: the
        grammar walks the drafts to fill them, then rolls back, so its state
        is unchanged when this returns.
        """
        if not structured_output_request_ids:
            return None
        max_num_spec_tokens = 0
        if self.vllm_config.speculative_config is not None:
            max_num_spec_tokens = self.vllm_config.speculative_config.num_speculative_tokens
        if self._grammar_bitmask is None:
            assert self.backend is not None
            max_batch_size = self.vllm_config.scheduler_config.max_num_seqs
            # int32 [max_num_seqs * (1 + k), ceil(vocab / 32)], allocated once
            self._grammar_bitmask = self.backend.allocate_token_bitmask(
                max_batch_size * (1 + max_num_spec_tokens)
            )

        # BEGIN LAB 12.2: the rows, request by request: one per draft, then one more
        # HINT: receives requests, structured_output_request_ids and
        # HINT: scheduled_spec_decode_tokens; leaves cumulative_index (rows filled).
        # HINT: Row i of a request's drafts is the mask after its drafts 0..i-1: fill,
        # HINT: then accept the draft into the grammar (unless should_fill_bitmask is
        # HINT: False or the grammar terminated); the last row follows every draft.
        # HINT: Roll the grammar back by what it accepted, so its state is unchanged.
        cumulative_index = 0
        for req_id in structured_output_request_ids:
            request = requests[req_id]
            grammar = request.structured_output_request.grammar
            assert grammar is not None
            apply_bitmask = self.should_fill_bitmask(request)
            state_advancements = 0
            for token in itertools.chain(scheduled_spec_decode_tokens.get(req_id, ()), (-1,)):
                self._fill_bitmasks(((grammar, cumulative_index, apply_bitmask),))
                if token == -1:
                    # The bonus row, or a padding draft: walk no further.
                    apply_bitmask = False
                if apply_bitmask and not grammar.is_terminated():
                    accepted = grammar.accept_tokens(req_id, [token])
                    assert accepted, (token, req_id, scheduled_spec_decode_tokens)
                    state_advancements += 1
                cumulative_index += 1
            if state_advancements > 0:
                grammar.rollback(state_advancements)
        # END LAB 12.2

        # int32 [cumulative_index, ceil(vocab / 32)]
        return self._grammar_bitmask[:cumulative_index].numpy()

    def should_fill_bitmask(self, request: Request) -> bool:
        """Always, without reasoning parsers (upstream: the reasoning part goes unmasked)."""
        return True

    def should_advance(self, request: Request) -> bool:
        """Whether the request's sampled tokens go through its grammar."""
        return request.use_structured_output

    def clear_backend(self) -> None:
        if self.backend is not None:
            self.backend.destroy()
