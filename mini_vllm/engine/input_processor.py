"""Validate a prompt and its sampling parameters and turn them into a Request.

Mirrors upstream ``vllm/v1/engine/input_processor.py`` (``InputProcessor``
:36, ``process_inputs`` :234; parameter checks in ``_validate_params`` :81,
prompt checks in ``_validate_prompt_len`` :379 and ``_validate_model_input``
:426, ``_validate_lora`` :138) at v0.22.1. Left out: pooling, prompt
embeddings mixed with token ids (``prompt_is_token_ids``), a LoRA adapter's
own tokenizer, multimodal inputs other than images (``multi_modal_uuids``,
the processor cache).

A prompt given as embeddings (``{"prompt_embeds": tensor [T, hidden]}``, with
``enable_prompt_embeds``) becomes a request of T placeholder token ids (zeros,
as upstream) that carries the tensor; the runner feeds those rows to the
model instead of looking the ids up.

A prompt dict with ``multi_modal_data`` (``{"prompt": "USER: <image>...",
"multi_modal_data": {"image": pil_image}}``) goes through the model's
multimodal processor (mini_vllm/multimodal/processing.py): its image tokens
are expanded and the request carries one ``MultiModalFeatureSpec`` per
image. A model without one refuses such a prompt, and an image whose
embeddings exceed the encoder cache can never be scheduled, so it is refused
here, as upstream's ``_validate_model_input`` does (:446-459).

What it does for each request: check that ``priority`` is an int and
``arrival_time`` a finite number or None (upstream only annotates these
types; a string would break the priority queue's ordering later); then, in
upstream's order, check the sampling parameters against the model (no more
than ``max_logprobs`` logprobs); tokenize a text prompt; reject an empty
prompt, one that leaves no room for output within max_model_len, and a
token id outside the model's vocabulary;
copy the sampling parameters (the caller's object is never changed), fill
``max_tokens`` when unset (max_model_len - prompt length, as upstream), and
record the model's EOS token; attach the block hasher for prefix caching;
refuse stop strings when the model has no tokenizer (upstream refuses them
without detokenization, vllm/sampling_params.py:540); check that
``logit_bias`` and ``allowed_token_ids`` name tokens of the vocabulary and
turn ``bad_words`` into token ids with the tokenizer (bad words need one);
check a structured-output constraint parses (``_validate_structured_outputs``:
a bad JSON schema, regex or grammar raises ValueError here, before the
request reaches the engine, as upstream's ``_validate_params`` does).

A prompt dict with both ``prompt`` and ``prompt_token_ids`` runs the ids
and reports the text as given, as upstream; ``prompt`` alone must be a string.

A ``max_tokens`` that reaches past max_model_len is accepted, as upstream:
the scheduler ends the request at max_model_len (finish reason "length").

Nothing that reaches the model can make a step fail: every token id is an
``int`` in ``[0, vocab_size)`` (upstream checks only the largest id, and only
when there is a tokenizer; mini_vllm checks every id always, see
UPSTREAM_PIN.md).
"""

from __future__ import annotations

import copy
import math
import time
from numbers import Integral, Real

import torch

from mini_vllm.core.kv_cache_utils import get_request_block_hasher, sha256
from mini_vllm.lora.request import LoRARequest
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
        *,
        vocab_size: int,
        max_logprobs: int = 20,
        logits_processors: list[type] | None = None,
        lora_config=None,
        mm_processor=None,
        mm_encoder_cache_size: int = 0,
        enable_prompt_embeds: bool = False,
        hidden_size: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        # A multimodal model's processor (None: text only) and its encoder
        # cache size, in embeddings.
        self.mm_processor = mm_processor
        self.mm_encoder_cache_size = mm_encoder_cache_size
        # Prompts as embeddings: allowed, and the width they must have.
        self.enable_prompt_embeds = enable_prompt_embeds
        self.hidden_size = hidden_size
        self.lora_config = lora_config
        self.logits_processors = list(logits_processors or ())
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs
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
                token_ids = prompt["prompt_token_ids"]
                if not isinstance(token_ids, (list, tuple)):
                    raise ValueError(
                        "prompt_token_ids must be a list of token ids, got "
                        f"{type(token_ids).__name__}."
                    )
                # Both keys: the ids run and the text is reported as given, as
                # upstream's renderer does (vllm/renderers/base.py:458, :730).
                return prompt.get("prompt") or None, list(token_ids)
            if "prompt" in prompt:
                if not isinstance(prompt["prompt"], str):
                    # upstream: "Prompt text should be a string"
                    # (vllm/renderers/inputs/preprocess.py:128)
                    raise ValueError(
                        "A prompt dict's 'prompt' must be a string (token ids go in "
                        f"'prompt_token_ids'), got {type(prompt['prompt']).__name__}."
                    )
                return self.tokenize(prompt["prompt"])
            raise ValueError(
                f"A prompt dict needs 'prompt' or 'prompt_token_ids', got {sorted(prompt)}."
            )
        if isinstance(prompt, list) and all(isinstance(t, Integral) for t in prompt):
            return None, list(prompt)
        raise ValueError(
            f"Unsupported prompt type {type(prompt).__name__}: use str, "
            "{'prompt_token_ids': [...]} or a list of token ids."
        )

    def _validate_model_input(self, request_id: str, token_ids: list) -> None:
        """Upstream's prompt checks: not empty, room for an output token, ids in the vocabulary."""
        if not token_ids:
            raise ValueError(f"Request {request_id!r}: the decoder prompt cannot be empty.")
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"Request {request_id!r}: the decoder prompt (length {len(token_ids)}) is "
                f"longer than the maximum model length of {self.max_model_len}. Make sure "
                "that `max_model_len` is no smaller than the number of text tokens."
            )
        if len(token_ids) == self.max_model_len:
            raise ValueError(
                f"Request {request_id!r}: the decoder prompt (length {len(token_ids)}) plus "
                "the number of requested output tokens (at least 1) is longer than the "
                f"maximum model length of {self.max_model_len}."
            )
        for token_id in token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, Integral):
                raise ValueError(
                    f"Request {request_id!r}: prompt_token_ids must contain only integers, "
                    f"got {type(token_id).__name__} {token_id!r}."
                )
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(
                    f"Request {request_id!r}: Token id {token_id} is out of vocabulary "
                    f"(vocab_size={self.vocab_size})."
                )

    def process_inputs(
        self,
        request_id: str,
        prompt,
        params: SamplingParams | None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> tuple[str | None, Request]:
        if isinstance(priority, bool) or not isinstance(priority, Integral):
            # upstream's type: ``priority: int`` (vllm/v1/engine/input_processor.py:244)
            raise ValueError(
                f"Request {request_id!r}: priority must be an integer, got "
                f"{type(priority).__name__} {priority!r}."
            )
        if arrival_time is not None and (
            isinstance(arrival_time, bool)
            or not isinstance(arrival_time, Real)
            or not math.isfinite(arrival_time)
        ):
            raise ValueError(
                f"Request {request_id!r}: arrival_time must be a finite number or None, got "
                f"{type(arrival_time).__name__} {arrival_time!r}."
            )
        self._validate_lora(request_id, lora_request)
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, but got {type(params).__name__}")
        params._validate_logprobs(self.max_logprobs, self.vocab_size)
        params._validate_vocab(self.vocab_size)
        for processor_cls in self.logits_processors:
            # upstream's validate_logits_processors_parameters
            # (vllm/v1/sample/logits_processor/__init__.py:223)
            processor_cls.validate_params(params)
        if params.stop and self.tokenizer is None:
            # Upstream: "stop strings are only supported when detokenize is True".
            raise ValueError(
                f"Request {request_id!r}: stop strings need a tokenizer, and this model has none."
            )
        prompt_embeds = None
        if isinstance(prompt, dict) and "prompt_embeds" in prompt:
            prompt_embeds = self._process_embeds(request_id, prompt["prompt_embeds"])
            # The prompt's token ids are placeholders (upstream: zeros).
            prompt_text, token_ids = None, [0] * prompt_embeds.shape[0]
        else:
            prompt_text, token_ids = self.tokenize(prompt)
        mm_features = []
        if isinstance(prompt, dict) and "multi_modal_data" in prompt:
            token_ids, mm_features = self._process_multimodal(
                request_id, token_ids, prompt["multi_modal_data"]
            )
        self._validate_model_input(request_id, token_ids)
        token_ids = [int(t) for t in token_ids]
        params = copy.deepcopy(params)
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError(
                    f"Request {request_id!r}: bad_words need a tokenizer, and this model has none."
                )
            params.update_from_tokenizer(self.tokenizer)
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError(
                    f"Request {request_id!r}: structured outputs need a tokenizer, and this "
                    "model has none."
                )
            params._validate_structured_outputs()
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - len(token_ids)
        params.update_from_generation_config(self.generation_config, self.eos_token_id)
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            arrival_time=float(arrival_time) if arrival_time is not None else time.time(),
            priority=int(priority),
            block_hasher=self.block_hasher,
            lora_request=lora_request,
            mm_features=mm_features,
            prompt_embeds=prompt_embeds,
        )
        return prompt_text, request

    def _process_embeds(self, request_id: str, prompt_embeds: object) -> torch.Tensor:
        """A prompt given as embeddings, checked: allowed by the engine, a float
        tensor [seq_len, hidden_size] (a batch of one is squeezed, as upstream's
        ``_process_embeds``, vllm/renderers/base.py:737), non-empty, of the
        model's width (upstream does not check the width: the step would fail)."""
        if not self.enable_prompt_embeds:
            raise ValueError(
                f"Request {request_id!r}: You must set `enable_prompt_embeds=True` to input "
                "`prompt_embeds`."
            )
        if not isinstance(prompt_embeds, torch.Tensor) or not prompt_embeds.is_floating_point():
            raise ValueError(
                f"Request {request_id!r}: prompt_embeds must be a float torch.Tensor, got "
                f"{type(prompt_embeds).__name__}."
            )
        if prompt_embeds.ndim == 3:
            prompt_embeds = prompt_embeds.squeeze(dim=0)
        if prompt_embeds.ndim != 2:
            raise ValueError(
                f"Request {request_id!r}: prompt_embeds must be of shape (seq_len, hidden_size)."
            )
        if self.hidden_size is not None and prompt_embeds.shape[1] != self.hidden_size:
            raise ValueError(
                f"Request {request_id!r}: prompt_embeds has hidden size "
                f"{prompt_embeds.shape[1]}; the model's is {self.hidden_size}."
            )
        return prompt_embeds.detach().cpu()

    def _process_multimodal(self, request_id: str, token_ids: list[int], multi_modal_data):
        """The prompt with its image tokens expanded, and its images' features."""
        if self.mm_processor is None:
            raise ValueError(
                f"Request {request_id!r}: this model takes no multi_modal_data "
                "(it is not a multimodal model)."
            )
        try:
            processed = self.mm_processor.apply(list(token_ids), multi_modal_data)
        except ValueError as e:
            raise ValueError(f"Request {request_id!r}: {e}") from e
        for feature in processed.mm_features:
            num_embeds = feature.mm_position.get_num_embeds()
            if num_embeds > self.mm_encoder_cache_size:
                # upstream's words (vllm/v1/engine/input_processor.py:451-459)
                raise ValueError(
                    f"Request {request_id!r}: the decoder prompt contains a(n) "
                    f"{feature.modality} item with {num_embeds} embedding tokens, which "
                    "exceeds the pre-allocated encoder cache size "
                    f"{self.mm_encoder_cache_size}. Please reduce the input size or "
                    "increase the encoder cache size."
                )
        return processed.prompt_token_ids, processed.mm_features

    def _validate_lora(self, request_id: str, lora_request: LoRARequest | None) -> None:
        """A LoRARequest needs an engine started with enable_lora (upstream's check)."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(
                f"Request {request_id!r}: lora_request must be a LoRARequest, got "
                f"{type(lora_request).__name__}."
            )
        if self.lora_config is None:
            raise ValueError(
                f"Request {request_id!r}: got lora_request {lora_request} but LoRA is not "
                "enabled (start the engine with enable_lora=True)."
            )
