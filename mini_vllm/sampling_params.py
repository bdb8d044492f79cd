"""Sampling parameters of one request.

Mirrors upstream ``vllm/sampling_params.py`` (class ``SamplingParams``, :168) at
v0.22.1: the same field names, defaults and validation messages for the
fields mini_vllm supports.
What is left out, and every deliberate difference: UPSTREAM_PIN.md.

Invariants kept:
- every bad value raises ``ValueError`` naming the field, at construction;
- ``temperature`` below 1e-5 means greedy, which resets ``top_p``/``top_k``;
- ``eos_token_id`` is set by the engine (``update_from_generation_config``),
  never by the user, and stays ``None`` when ``ignore_eos`` is on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_SAMPLING_EPS = 1e-5
_MAX_TEMP = 1e-2


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
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
    # Filled in by the engine from the model's generation config.
    _eos_token_id: int | None = field(default=None, repr=False)
    _all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if 0 < self.temperature < _MAX_TEMP:
            # Upstream raises tiny temperatures to 1e-2 to avoid inf/nan.
            self.temperature = _MAX_TEMP
        if self.seed == -1:
            self.seed = None
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        else:
            self.stop_token_ids = list(self.stop_token_ids)
        self._verify_args()
        if self.temperature < _SAMPLING_EPS:
            self.top_p = 1.0
            self.top_k = 0
        self._all_stop_token_ids.update(self.stop_token_ids)

    # mirrors vllm/sampling_params.py:452-550
    def _verify_args(self) -> None:
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool):
            raise ValueError(f"top_k must be an integer, got {type(self.top_k).__name__}.")
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
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
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}.")

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
