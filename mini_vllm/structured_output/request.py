"""A request's structured-output state: its constraint and its grammar (or the future of one).

Mirrors upstream ``vllm/v1/structured_output/request.py`` at v0.22.1
(``StructuredOutputRequest`` :22, ``get_structured_output_key`` :77). Left
out: the reasoning-parser fields (mini_vllm has no reasoning parsers). See
UPSTREAM_PIN.md.

Invariants kept:
- ``grammar`` is None while the compile is still running, and the compiled
  grammar once it has finished: the scheduler polls it to know whether a
  request waiting in WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR may run;
- a compile that raised re-raises from ``grammar`` (the scheduler turns
  that into a failed request, see ``Scheduler._try_promote_blocked_waiting_request``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError

from mini_vllm.sampling_params import SamplingParams, StructuredOutputsParams
from mini_vllm.structured_output.backend_types import (
    StructuredOutputGrammar,
    StructuredOutputKey,
    StructuredOutputOptions,
)


@dataclasses.dataclass
class StructuredOutputRequest:
    params: StructuredOutputsParams
    _grammar: Future[StructuredOutputGrammar] | StructuredOutputGrammar | None = None

    @staticmethod
    def from_sampling_params(
        sampling_params: SamplingParams | None,
    ) -> StructuredOutputRequest | None:
        """None unless the request carries a constraint."""
        if sampling_params is None:
            return None
        params = sampling_params.structured_outputs
        if params is None or params.all_constraints_none():
            return None
        return StructuredOutputRequest(params=params)

    def _check_grammar_completion(self) -> bool:
        """True once the grammar is compiled (the future is swapped for its result).

        Upstream waits up to 100 us for the future (request.py:47); a
        finished future answers at once either way, so mini_vllm does not wait.
        """
        if isinstance(self._grammar, Future):
            try:
                self._grammar = self._grammar.result(timeout=0)
            except FutureTimeoutError:
                return False
        return True

    @property
    def is_grammar_ready(self) -> bool:
        return self._check_grammar_completion()

    @property
    def grammar(self) -> StructuredOutputGrammar | None:
        completed = self._check_grammar_completion()
        return self._grammar if completed else None  # type: ignore[return-value]

    @grammar.setter
    def grammar(self, grammar: StructuredOutputGrammar | Future[StructuredOutputGrammar]) -> None:
        self._grammar = grammar

    @functools.cached_property
    def structured_output_key(self) -> StructuredOutputKey:
        return get_structured_output_key(self.params)


def get_structured_output_key(params: StructuredOutputsParams) -> StructuredOutputKey:
    """(kind, text) of the one constraint set; a dict schema or choice list as JSON text."""
    if params.json is not None:
        json_str = params.json if isinstance(params.json, str) else json.dumps(params.json)
        return StructuredOutputOptions.JSON, json_str
    if params.json_object:
        return StructuredOutputOptions.JSON_OBJECT, ""
    if params.regex is not None:
        return StructuredOutputOptions.REGEX, params.regex
    if params.choice is not None:
        choice = params.choice if isinstance(params.choice, str) else json.dumps(params.choice)
        return StructuredOutputOptions.CHOICE, choice
    if params.grammar is not None:
        return StructuredOutputOptions.GRAMMAR, params.grammar
    raise ValueError("No valid structured output parameter found")
