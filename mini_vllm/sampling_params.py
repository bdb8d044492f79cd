"""Sampling parameters of one request.

Mirrors upstream ``vllm/sampling_params.py`` (class ``SamplingParams``, :168,
and ``StructuredOutputsParams``, :41) at v0.22.1: the same field names,
defaults and validation messages for the fields mini_vllm supports.
What is left out, and every deliberate difference: UPSTREAM_PIN.md.

Invariants kept:
- every bad value raises ``ValueError`` naming the field, at construction;
  unlike upstream (a msgspec struct, whose types are checked only by the
  OpenAI server's pydantic models) that includes a wrong type: integers
  where upstream's annotation says ``int``, finite numbers for
  ``temperature`` and ``top_p``, a seed that fits in an int64 (the range
  upstream's server accepts); see UPSTREAM_PIN.md;
- ``temperature`` below 1e-5 means greedy, which resets ``top_p``/``top_k``;
- ``eos_token_id`` is set by the engine (``update_from_generation_config``),
  never by the user, and stays ``None`` when ``ignore_eos`` is on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Any

_SAMPLING_EPS = 1e-5
_MAX_TEMP = 1e-2
# The seed range upstream's OpenAI server accepts: an int64
# (vllm/entrypoints/openai/completion/protocol.py:60).
_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1

# The constraint kinds of StructuredOutputsParams mini_vllm serves, and the
# options upstream has that it leaves out (refused by name).
_CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_LEFT_OUT_OPTIONS = (
    "structural_tag",
    "disable_any_whitespace",
    "disable_additional_properties",
    "whitespace_pattern",
)


@dataclass
class StructuredOutputsParams:
    """One constraint on a request's output (mirrors vllm/sampling_params.py:41).

    Exactly one of ``json`` (a JSON schema, as a dict or a string), ``regex``,
    ``choice`` (a list of strings), ``grammar`` (EBNF) or ``json_object``
    (any JSON object) is set. Upstream's other options (``structural_tag``,
    the whitespace and additional-properties switches) are refused by name:
    see UPSTREAM_PIN.md.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        for name in _LEFT_OUT_OPTIONS:
            if getattr(self, name) not in (None, False):
                raise ValueError(
                    f"structured_outputs.{name} is not supported by mini_vllm "
                    "(see UPSTREAM_PIN.md)."
                )
        # Upstream's two messages (vllm/sampling_params.py:59-80).
        count = sum(getattr(self, name) is not None for name in _CONSTRAINT_KINDS)
        if count > 1:
            raise ValueError(
                "You can only use one kind of structured outputs constraint "
                f"but multiple are specified: {self.__dict__}"
            )
        if count < 1:
            raise ValueError(
                "You must use one kind of structured outputs constraint "
                f"but none are specified: {self.__dict__}"
            )

    def all_constraints_none(self) -> bool:
        """True when no constraint is set (vllm/sampling_params.py:82)."""
        return all(getattr(self, name) is None for name in _CONSTRAINT_KINDS)


def _check_int(name: str, value, allow_none: bool = False):
    """``value`` as a Python int; a ValueError naming ``name`` if it is not an integer."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__} {value!r}.")
    return int(value)


def _check_real(name: str, value) -> float:
    """``value`` as a float; a ValueError naming ``name`` if it is not a finite number."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name} must be a number, got {type(value).__name__} {value!r}.")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}.")
    return float(value)


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    # Strings that end the request when they appear in the output text
    # (checked by the front end's detokenizer, not by the scheduler).
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    # Strings whose tokens may not be generated; the input processor turns
    # them into token-id lists (``update_from_tokenizer``).
    bad_words: list[str] | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None
    # Free-form per-request arguments, read by custom logits processors.
    extra_args: dict[str, Any] | None = None
    # A constraint on the output (JSON schema, regex, choice, grammar):
    # mini_vllm/structured_output/.
    structured_outputs: StructuredOutputsParams | None = None
    # Filled in by the engine from the model's generation config.
    _eos_token_id: int | None = field(default=None, repr=False)
    _all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    _bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.logprobs is True:
            self.logprobs = 1  # as upstream: logprobs=True asks for one
        self._check_types()
        if 0 < self.temperature < _MAX_TEMP:
            # Upstream raises tiny temperatures to 1e-2 to avoid inf/nan.
            self.temperature = _MAX_TEMP
        if self.seed == -1:
            self.seed = None
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(
                f"stop must be a string or a list of strings, got {type(self.stop).__name__}."
            )
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            raise ValueError(
                "stop_token_ids must be a list of integers, got "
                f"{type(self.stop_token_ids).__name__}."
            )
        if self.bad_words is None:
            self.bad_words = []
        elif isinstance(self.bad_words, (list, tuple)):
            self.bad_words = list(self.bad_words)
        else:
            raise ValueError(
                f"bad_words must be a list of strings, got {type(self.bad_words).__name__}."
            )
        self._verify_args()
        if self.temperature < _SAMPLING_EPS:
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0
        self._all_stop_token_ids.update(self.stop_token_ids)

    def _check_types(self) -> None:
        """Numbers where numbers belong, before any comparison (mini_vllm's
        addition: upstream's msgspec struct does not check types at
        construction, so ``max_tokens=2.5`` or ``temperature=nan`` get through).
        Integral values (numpy ints included) become Python ints."""
        self.temperature = _check_real("temperature", self.temperature)
        self.top_p = _check_real("top_p", self.top_p)
        self.top_k = _check_int("top_k", self.top_k)
        self.min_p = _check_real("min_p", self.min_p)
        self.presence_penalty = _check_real("presence_penalty", self.presence_penalty)
        self.frequency_penalty = _check_real("frequency_penalty", self.frequency_penalty)
        self.repetition_penalty = _check_real("repetition_penalty", self.repetition_penalty)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(
                    "logit_bias must be a dict of token id -> bias, got "
                    f"{type(self.logit_bias).__name__}."
                )
            self.logit_bias = {
                _check_int("logit_bias token id", token_id): _check_real("logit_bias", bias)
                for token_id, bias in self.logit_bias.items()
            }
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)):
                raise ValueError(
                    "allowed_token_ids must be a list of integers, got "
                    f"{type(self.allowed_token_ids).__name__}."
                )
            self.allowed_token_ids = [
                _check_int("allowed_token_ids", t) for t in self.allowed_token_ids
            ]
        self.max_tokens = _check_int("max_tokens", self.max_tokens, allow_none=True)
        self.min_tokens = _check_int("min_tokens", self.min_tokens)
        self.logprobs = _check_int("logprobs", self.logprobs, allow_none=True)
        self.seed = _check_int("seed", self.seed, allow_none=True)

    # mirrors vllm/sampling_params.py:452-550
    def _verify_args(self) -> None:
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if self.repetition_penalty <= 0.0:
            raise ValueError(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}."
            )
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(
                f"min_tokens must be greater than or equal to 0, got {self.min_tokens}."
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}."
            )
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must contain only integers, got {self.stop_token_ids}."
            )
        if not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must contain only strings, got {self.stop}.")
        if any(not stop_str for stop_str in self.stop):
            raise ValueError("stop cannot contain an empty string.")
        if self.logprobs is not None and self.logprobs != -1 and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative or -1, got {self.logprobs}.")
        if not all(isinstance(w, str) for w in self.bad_words):
            raise ValueError(f"bad_words must contain only strings, got {self.bad_words}.")
        if any(not bad_word for bad_word in self.bad_words):
            raise ValueError(
                f"bad_words cannot contain an empty string. Got bad_words={self.bad_words}"
            )
        if self.allowed_token_ids is not None and len(self.allowed_token_ids) == 0:
            raise ValueError("allowed_token_ids is not None and empty!")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError(
                "structured_outputs must be a StructuredOutputsParams, got "
                f"{type(self.structured_outputs).__name__}."
            )
        if self.seed is not None and not _SEED_MIN <= self.seed <= _SEED_MAX:
            raise ValueError(f"seed must be in [{_SEED_MIN}, {_SEED_MAX}], got {self.seed}.")

    def _validate_logprobs(self, max_logprobs: int, vocab_size: int) -> None:
        """At most ``max_logprobs`` logprobs a token (-1: the whole vocabulary).

        Upstream's check (``SamplingParams._validate_logprobs``, run by the
        input processor), plus a cap at the vocabulary size, which upstream
        leaves to the sampler to trip over.
        """
        allowed = vocab_size if max_logprobs == -1 else min(max_logprobs, vocab_size)
        num_logprobs = vocab_size if self.logprobs == -1 else self.logprobs
        if num_logprobs and num_logprobs > allowed:
            raise ValueError(
                f"Requested sample logprobs of {num_logprobs}, "
                f"which is greater than max allowed: {allowed}"
            )

    def _validate_vocab(self, vocab_size: int) -> None:
        """Token ids in ``logit_bias`` and ``allowed_token_ids`` within the vocabulary.

        Upstream's ``_validate_logit_bias`` and ``_validate_allowed_token_ids``
        (vllm/sampling_params.py:727, :754), run by the input processor.
        """
        if self.logit_bias:
            invalid = [t for t in self.logit_bias if t < 0 or t >= vocab_size]
            if invalid:
                raise ValueError(
                    f"token_id(s) {invalid} in logit_bias contain out-of-vocab token ids. "
                    f"Vocabulary size: {vocab_size}"
                )
        if self.allowed_token_ids is not None:
            if any(t < 0 or t >= vocab_size for t in self.allowed_token_ids):
                raise ValueError("allowed_token_ids contains out-of-vocab token id!")

    def _validate_structured_outputs(self) -> None:
        """Refuse a constraint xgrammar cannot parse, with a ValueError.

        Upstream's checks (vllm/sampling_params.py:794; the backend is always
        xgrammar here), run by the input processor on its copy of the
        parameters: a ``choice`` becomes the equivalent ``grammar``.
        """
        so_params = self.structured_outputs
        if so_params is None:
            return
        if isinstance(so_params.choice, list) and not so_params.choice:
            raise ValueError(f"Choice '{so_params.choice}' cannot be an empty list")
        if isinstance(so_params.grammar, str) and so_params.grammar.strip() == "":
            raise ValueError("structured_outputs.grammar cannot be an empty string")
        from mini_vllm.structured_output.backend_xgrammar import validate_xgrammar_grammar

        validate_xgrammar_grammar(self)
        so_params.__post_init__()

    def update_from_tokenizer(self, tokenizer) -> None:
        """Turn ``bad_words`` into token-id lists, as upstream (vllm/sampling_params.py:586).

        Each word is encoded as written (leading spaces stripped) and, if that
        gives a different first token of the same length, once more after a
        space, so the word is banned at the start of the text and mid-text.
        """
        if not self.bad_words:
            return
        self._bad_words_token_ids = []
        for bad_word in self.bad_words:
            word = bad_word.lstrip()
            plain = tokenizer.encode(word, add_special_tokens=False)
            self._bad_words_token_ids.append(plain)
            spaced = tokenizer.encode(" " + word, add_special_tokens=False)
            if spaced[0] != plain[0] and len(spaced) == len(plain):
                self._bad_words_token_ids.append(spaced)
        max_token_id = max(max(tokenizer.get_vocab().values()), tokenizer.vocab_size)
        invalid = [t for ids in self._bad_words_token_ids for t in ids if t < 0 or t > max_token_id]
        if invalid:
            raise ValueError(
                f"The model vocabulary size is {max_token_id + 1}, but the following tokens "
                f"were specified as bad: {invalid}. All token id values should be integers "
                f"satisfying: 0 <= token_id <= {max_token_id}."
            )

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        return self._bad_words_token_ids

    # mirrors vllm/sampling_params.py:556-584
    def update_from_generation_config(
        self, generation_config: dict[str, Any], eos_token_id: int | None = None
    ) -> None:
        """Record the model's EOS id (what upstream's InputProcessor does)."""
        if not self.ignore_eos:
            self._eos_token_id = eos_token_id
        if eos_token_id is not None:
            self._all_stop_token_ids.add(eos_token_id)
        eos_ids = generation_config.get("eos_token_id")
        if eos_ids is not None:
            eos_ids = {eos_ids} if isinstance(eos_ids, int) else set(eos_ids)
            eos_ids.discard(eos_token_id)
            if eos_ids:
                self._all_stop_token_ids.update(eos_ids)
                if not self.ignore_eos:
                    eos_ids.update(self.stop_token_ids)
                    self.stop_token_ids = sorted(eos_ids)

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    @property
    def all_stop_token_ids(self) -> set[int]:
        return self._all_stop_token_ids

    @property
    def sampling_type_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS
