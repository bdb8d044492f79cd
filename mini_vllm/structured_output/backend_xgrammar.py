"""The xgrammar backend: compile a constraint against the vocabulary, match tokens, fill bitmasks.

Mirrors upstream ``vllm/v1/structured_output/backend_xgrammar.py`` at v0.22.1
(``XgrammarBackend`` :35, ``compile_grammar`` :77, ``XgrammarGrammar`` :132,
``has_xgrammar_unsupported_json_features`` :221, ``validate_xgrammar_grammar``
:268). Left out: Mistral tokenizers, structural tags, Lark grammars (upstream
converts them to EBNF; mini_vllm takes EBNF only), the compile cache's size
setting and the whitespace switches. See UPSTREAM_PIN.md.

xgrammar (0.2.8, the version the pin runs with) is imported when a
structured request first needs it, so the rest of mini_vllm runs without it.

Invariants kept:
- the vocabulary xgrammar sees is the model's (``vocab_size`` columns of the
  bitmask, ``ceil(vocab_size / 32)`` int32 words a row), built from the
  Hugging Face tokenizer as upstream builds it (``TokenizerInfo.from_huggingface``);
- a matcher can roll back the drafts it walked (xgrammar 0.2.8 rolls back
  without limit; upstream still sets ``max_rollback_tokens``, which it ignores).
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from typing import Any

import torch

from mini_vllm.sampling_params import SamplingParams
from mini_vllm.structured_output.backend_types import (
    StructuredOutputBackend,
    StructuredOutputGrammar,
    StructuredOutputOptions,
)
from mini_vllm.structured_output.utils import choice_as_grammar

XGRAMMAR_INSTALL = "pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2"


def _import_xgrammar():
    """The xgrammar module, or an ImportError that says how to install it."""
    try:
        return importlib.import_module("xgrammar")
    except ImportError as e:
        raise ImportError(
            "Structured outputs need xgrammar, which is not installed. Install it into "
            f"this environment with `{XGRAMMAR_INSTALL}` (it also imports pydantic), or run "
            "`make xgrammar`."
        ) from e


@dataclass
class XgrammarBackend(StructuredOutputBackend):
    def __post_init__(self) -> None:
        xgr = _import_xgrammar()
        tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            self.tokenizer, vocab_size=self.vocab_size
        )
        # Upstream: max_threads=8, a cache capped by VLLM_XGRAMMAR_CACHE_MB.
        self.compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=8, cache_enabled=True)

    def compile_grammar(
        self, request_type: StructuredOutputOptions, grammar_spec: str
    ) -> StructuredOutputGrammar:
        xgr = _import_xgrammar()
        if request_type == StructuredOutputOptions.JSON:
            ctx = self.compiler.compile_json_schema(grammar_spec, any_whitespace=True)
        elif request_type == StructuredOutputOptions.JSON_OBJECT:
            ctx = self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=True)
        elif request_type == StructuredOutputOptions.GRAMMAR:
            ctx = self.compiler.compile_grammar(grammar_spec)
        elif request_type == StructuredOutputOptions.REGEX:
            ctx = self.compiler.compile_regex(grammar_spec)
        else:
            # CHOICE was turned into GRAMMAR by validate_xgrammar_grammar.
            raise ValueError(f"grammar is not of valid supported types. ({request_type!s})")
        # Upstream passes max_rollback_tokens=num_speculative_tokens; xgrammar
        # 0.2.8 deprecates it (rollback is always unlimited) and warns.
        return XgrammarGrammar(
            matcher=xgr.GrammarMatcher(ctx),
            vocab_size=self.vocab_size,
            ctx=ctx,
        )

    def allocate_token_bitmask(self, max_num_seqs: int) -> torch.Tensor:
        # int32 [max_num_seqs, ceil(vocab_size / 32)], all bits set
        return _import_xgrammar().allocate_token_bitmask(max_num_seqs, self.vocab_size)

    def destroy(self) -> None:
        del self.compiler


@dataclass
class XgrammarGrammar(StructuredOutputGrammar):
    vocab_size: int
    matcher: Any = field(hash=False)
    ctx: Any = field(hash=False)
    num_processed_tokens: int = field(default=0, repr=False, hash=False, init=False)
    _is_terminated: bool = field(default=False, repr=False, hash=False)

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        if self._is_terminated:
            return False
        for token in tokens:
            if not self.matcher.accept_token(token):
                return False
            self.num_processed_tokens += 1
        self._is_terminated = self.matcher.is_terminated()
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        accepted: list[int] = []
        for token in tokens:
            if not self.matcher.accept_token(token):
                break
            accepted.append(token)
        if accepted:
            self.matcher.rollback(len(accepted))  # back where it started
        return accepted

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)
        self.num_processed_tokens -= num_tokens
        self._is_terminated = self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, idx: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, idx)

    def is_terminated(self) -> bool:
        return self._is_terminated

    def reset(self) -> None:
        self.num_processed_tokens = 0
        self.matcher.reset()


# The string formats xgrammar's JSON-schema converter knows
# (upstream's list, backend_xgrammar.py:203).
STRING_SUPPORTED_FORMATS = {
    "email",
    "date",
    "time",
    "date-time",
    "duration",
    "ipv4",
    "ipv6",
    "hostname",
    "uuid",
    "uri",
    "uri-reference",
    "uri-template",
    "json-pointer",
    "relative-json-pointer",
}


def has_xgrammar_unsupported_json_features(schema: dict[str, Any]) -> bool:
    """Whether the schema, anywhere inside, uses a keyword xgrammar cannot enforce."""

    def check(obj: Any) -> bool:
        if not isinstance(obj, dict):
            return False
        kind = obj.get("type")
        if kind in ("integer", "number") and "multipleOf" in obj:
            return True
        if kind == "array" and any(
            k in obj for k in ("uniqueItems", "contains", "minContains", "maxContains")
        ):
            return True
        if kind == "string" and "format" in obj and obj["format"] not in STRING_SUPPORTED_FORMATS:
            return True
        if kind == "object" and any(k in obj for k in ("patternProperties", "propertyNames")):
            return True
        for value in obj.values():
            items = value if isinstance(value, list) else [value]
            if any(check(item) for item in items):
                return True
        return False

    return check(schema)


def validate_xgrammar_grammar(sampling_params: SamplingParams) -> None:
    """Refuse, with a ValueError, a constraint xgrammar cannot parse.

    Runs in the input processor, before the request reaches the engine core,
    as upstream's does (vllm/sampling_params.py:852). A ``choice`` becomes
    the equivalent EBNF ``grammar`` here, so the backend never sees CHOICE.
    """
    so_params = sampling_params.structured_outputs
    if so_params is None:
        return
    xgr = _import_xgrammar()
    if so_params.regex:
        try:
            xgr.Grammar.from_regex(so_params.regex)
        except Exception as err:
            raise ValueError(f"Failed to transform regex into a grammar: {err}") from err
    if so_params.choice:
        choice_grammar = choice_as_grammar(so_params.choice)
        try:
            xgr.Grammar.from_ebnf(choice_grammar)
        except Exception as err:
            raise ValueError(f"Failed to transform choices into a grammar: {err}") from err
        so_params.choice = None
        so_params.grammar = choice_grammar
        return
    if so_params.json:
        if isinstance(so_params.json, str):
            try:
                schema = json.loads(so_params.json)
            except json.JSONDecodeError as e:
                raise ValueError("Invalid JSON grammar specification.") from e
        else:
            schema = so_params.json
        if has_xgrammar_unsupported_json_features(schema):
            raise ValueError(
                "The provided JSON schema contains features not supported by xgrammar."
            )
        try:
            xgr.Grammar.from_json_schema(schema)
        except Exception as err:
            raise ValueError(f"Failed to transform json schema into a grammar: {err}") from err
        return
    if so_params.grammar:
        try:
            xgr.Grammar.from_ebnf(so_params.grammar)
        except Exception as e:
            raise ValueError("Invalid grammar specification.") from e
