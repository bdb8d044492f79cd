"""Validate a prompt and its sampling parameters and turn them into a Request.

Mirrors upstream ``vllm/v1/engine/input_processor.py`` (``InputProcessor``
:36, ``process_inputs`` :234; prompt checks in ``_validate_prompt_len`` at
:379) at v0.22.1. Left out:
multimodal inputs, LoRA, pooling, prompt embeddings, tokenizer-side
bad-word handling.

What it does for each request: tokenize a text prompt; reject an empty one
or one that leaves no room for output within max_model_len; copy the
sampling parameters (the caller's object is never changed), fill
``max_tokens`` when unset (max_model_len - prompt length, as upstream), and
record the model's EOS token; attach the block hasher for prefix caching;
refuse stop strings when the model has no tokenizer (upstream refuses them
without detokenization, vllm/sampling_params.py:540).
"""

from __future__ import annotations

import copy
import time

from mini_vllm.core.kv_cache_utils import get_request_block_hasher, sha256
from mini_vllm.request import Request
from mini_vllm.sampling_params import SamplingParams


class InputProcessor:
    def __init__(
        self,
        tokenizer,
        max_model_len: int,
        block_size: int,
        eos_token_id: int | None,
        generation_config: dict | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.generation_config = generation_config or {}
        self.block_hasher = get_request_block_hasher(block_size, sha256)

    def tokenize(self, prompt: str | dict | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("This model has no tokenizer: pass prompt_token_ids.")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise ValueError(
                f"A prompt dict needs 'prompt' or 'prompt_token_ids', got {sorted(prompt)}."
            )
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(
            f"Unsupported prompt type {type(prompt).__name__}: use str, "
            "{'prompt_token_ids': [...]} or a list of token ids."
        )

    def process_inputs(
        self,
        request_id: str,
        prompt,
        params: SamplingParams | None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> tuple[str | None, Request]:
        prompt_text, token_ids = self.tokenize(prompt)
        if not token_ids:
            raise ValueError(f"Request {request_id!r}: the prompt cannot be empty.")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"Request {request_id!r}: the prompt (length {len(token_ids)}) is too long: "
                f"it must be shorter than max_model_len={self.max_model_len} so that at "
                "least one token can be generated."
            )
        params = copy.deepcopy(params) if params is not None else SamplingParams()
        if params.stop and self.tokenizer is None:
            # Upstream: "stop strings are only supported when detokenize is True".
            raise ValueError(
                f"Request {request_id!r}: stop strings need a tokenizer, and this model has none."
            )
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - len(token_ids)
        params.update_from_generation_config(self.generation_config, self.eos_token_id)
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            priority=priority,
            block_hasher=self.block_hasher,
        )
        return prompt_text, request
