"""The synchronous engine: requests in, RequestOutputs out, one step at a time.

Mirrors upstream ``vllm/v1/engine/llm_engine.py`` (``LLMEngine`` :47:
``add_request`` :209, ``step`` :287, ``abort_request`` :203,
``has_unfinished_requests`` :182) at v0.22.1. ``record_stats`` stands in for
upstream's stats loggers (``logger_manager.record`` inside ``step``). Left out:
the engine-core client/process split, multiple engines, stats loggers, LoRA,
pooling, n > 1.

Pieces, in the order a request meets them: InputProcessor (tokenize,
validate, build the Request) -> EngineCore (scheduler + model runner) ->
OutputProcessor (detokenize, metrics, RequestOutput).
"""

from __future__ import annotations

import os
import sys

import torch

from mini_vllm.config import DeviceConfig, VllmConfig
from mini_vllm.engine.core import EngineCore
from mini_vllm.engine.input_processor import InputProcessor
from mini_vllm.engine.output_processor import OutputProcessor
from mini_vllm.metrics.stats import PrefixCacheStats
from mini_vllm.outputs import RequestOutput
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.spec_decode.metrics import SpecDecodingStats

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    """A torch device for a DeviceConfig name; ValueError for one torch cannot use here."""
    DeviceConfig(device=name).verify()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} was asked for but CUDA is not available here.")
    try:
        return torch.device(name)
    except RuntimeError as e:  # e.g. "cuda:x"
        raise ValueError(f"device={name!r} is not a torch device: {e}") from e


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype must be auto, {', '.join(_DTYPES)}, got {name!r}.")
    return _DTYPES[name]


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """'auto' -> triton on CUDA, cpu on CPU; any other name as it is."""
    if name == "auto":
        return "triton" if device.type == "cuda" else "cpu"
    return name


# Backends whose store casts to the cache dtype and whose reads cast to float32.
FP8_KV_CACHE_BACKENDS = ("torch", "cpu")


def verify_kv_cache_dtype(kv_cache_dtype: str, backend: str) -> None:
    """Refuse an fp8 KV cache on a backend that cannot run one, in upstream's words
    (vllm/platforms/cuda.py:314)."""
    if kv_cache_dtype.startswith("fp8") and backend not in FP8_KV_CACHE_BACKENDS:
        raise ValueError(
            f"Selected backend {backend} is not valid for this configuration. Reason: "
            f"['kv_cache_dtype not supported'] (kv_cache_dtype={kv_cache_dtype!r} runs on "
            f"the {' and '.join(FP8_KV_CACHE_BACKENDS)} backends)"
        )


class LLMEngine:
    def __init__(self, vllm_config: VllmConfig, loaded=None) -> None:
        """``loaded``: a (model, hf_config, tokenizer) already loaded on the
        configured device and dtype, to avoid reading the checkpoint twice."""
        from mini_vllm.model_executor.model_loader import load_model

        self.vllm_config = vllm_config
        model_config = vllm_config.model_config
        self.device = resolve_device(vllm_config.device_config.device)
        self.dtype = resolve_dtype(model_config.dtype, self.device)
        backend = resolve_attention_backend(vllm_config.attention_config.backend, self.device)
        verify_kv_cache_dtype(vllm_config.cache_config.cache_dtype, backend)
        if backend == "triton" and self.device.type == "cpu":
            # Triton has no CPU target: its interpreter runs the kernels. The
            # switch is read when triton is first imported (its own library
            # functions are decorated then), so it cannot be flipped later.
            if os.environ.get("TRITON_INTERPRET") != "1":
                if "triton" in sys.modules:
                    raise ValueError(
                        "The Triton backend on a CPU needs Triton's interpreter, which must be "
                        "switched on before triton is imported: set TRITON_INTERPRET=1 in the "
                        "environment (the mini-vllm CLI does this itself)."
                    )
                os.environ["TRITON_INTERPRET"] = "1"
        self.attention_backend = backend

        torch.manual_seed(model_config.seed)
        if loaded is None:
            if model_config.model is None:
                raise ValueError("model_config.model must name a model path")
            loaded = load_model(
                model_config.model,
                device=self.device,
                dtype=self.dtype,
                quantization=model_config.quantization,
            )
        self.model, self.hf_config, self.tokenizer = loaded
        model_config.verify_max_model_len(self.hf_config)
        model_config.verify_with_parallel_config(self.hf_config, vllm_config.parallel_config)
        # A multimodal model's processor (Phase 13); the scheduler's encoder
        # budgets are sized from the embeddings one item can fill.
        self.mm_processor = None
        if getattr(self.hf_config, "vision_config", None) is not None:
            from mini_vllm.multimodal.processing import LlavaMultiModalProcessor

            self.mm_processor = LlavaMultiModalProcessor.from_pretrained(
                model_config.model, self.hf_config
            )
            model_config.mm_max_tokens_per_item = {
                "image": self.mm_processor.get_num_image_tokens()
            }
        self.engine_core = EngineCore(
            vllm_config, self.model, self.device, self.dtype, backend, tokenizer=self.tokenizer
        )

        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        if eos is None:
            eos = getattr(self.hf_config.get_text_config(), "eos_token_id", None)
            if isinstance(eos, list):
                eos = eos[0] if eos else None
        self.input_processor = InputProcessor(
            self.tokenizer,
            model_config.max_model_len,
            vllm_config.cache_config.block_size,
            eos,
            vocab_size=self.hf_config.get_text_config().vocab_size,
            max_logprobs=model_config.max_logprobs,
            logits_processors=model_config.logits_processors,
            lora_config=vllm_config.lora_config,
            mm_processor=self.mm_processor,
            enable_prompt_embeds=model_config.enable_prompt_embeds,
            hidden_size=self.hf_config.get_text_config().hidden_size,
            mm_encoder_cache_size=self.engine_core.scheduler.encoder_cache_manager.cache_size
            if self.mm_processor is not None
            else 0,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.prefix_cache_stats = PrefixCacheStats()
        # Totals of every step's SpecDecodingStats (all zero without speculation).
        spec = vllm_config.speculative_config
        self.spec_decoding_stats = SpecDecodingStats.new(
            spec.num_speculative_tokens if spec is not None else 0
        )

    def add_request(
        self,
        request_id: str,
        prompt,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request=None,
    ) -> None:
        """Queue a request: all of its state or none. ``lora_request``: the
        adapter it runs with (a LoRARequest; needs ``enable_lora``).

        Bad input raises (ValueError; TypeError for a request id that is not a
        string, as upstream) before anything is added. The request then goes
        to the output processor and to EngineCore, in upstream's order; if
        either raises (Ctrl-C included), what was added is taken back, so the
        engine is as it was and later requests and steps work.
        """
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__}.")
        if request_id in self.output_processor.request_states:
            raise ValueError(f"Duplicate request id {request_id!r}.")
        prompt_text, request = self.input_processor.process_inputs(
            request_id, prompt, params, arrival_time, priority, lora_request
        )
        if request.lora_request is not None:
            self._check_adapter(request.lora_request)
        try:
            self.output_processor.add_request(
                request_id,
                prompt_text,
                request.prompt_token_ids,
                request.arrival_time,
                request.sampling_params,
            )
            self.engine_core.add_request(request)
        except BaseException:
            # The id was new (checked above): whatever state it has is this request's.
            self.output_processor.abort_requests([request_id])
            raise

    def _check_adapter(self, lora_request) -> None:
        """Read an adapter the runner does not hold yet, so that a bad one (a
        missing file, a rank above max_lora_rank, a module the model lacks)
        fails this request with a ValueError before it is queued; upstream
        finds out in the worker, at the adapter's first step."""
        manager = self.engine_core.model_runner.lora_manager
        if lora_request.lora_int_id not in manager.list_adapters():
            manager.load_adapter(lora_request)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Abort from the user: forget in the front end, then free in EngineCore."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        request_ids = self.output_processor.abort_requests(request_ids)
        self.engine_core.abort_requests(request_ids)

    def fail_requests(self, request_ids: list[str]) -> None:
        """After ``step()`` raised: abort these requests everywhere and forget
        their KV (``EngineCore.fail_requests``), so that the engine can go on.
        ``LLM.generate`` does this for its requests on any exception."""
        self.output_processor.abort_requests(request_ids)
        self.engine_core.fail_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    # BEGIN LAB 01.2: one front-end step: core outputs in, RequestOutputs out, stop strings aborted
    def step(self) -> list[RequestOutput]:
        """Run one EngineCore step and turn its outputs into RequestOutputs.

        A request that the output processor finished on a stop string is
        still running in EngineCore: abort it there, so that its KV blocks
        are freed and it is never scheduled again.
        """
        # HINT: upstream's four steps (llm_engine.py:287): get the core's outputs,
        # HINT: process them, abort processed.reqs_to_abort, record the stats
        # HINT: (self.record_stats(outputs.scheduler_stats)).
        outputs = self.engine_core.step_fn()
        processed = self.output_processor.process_outputs(outputs)
        self.engine_core.abort_requests(processed.reqs_to_abort)
        self.record_stats(outputs.scheduler_stats)
        return processed.request_outputs

    # END LAB 01.2

    def record_stats(self, stats) -> None:
        """Add one step's prefix-cache and spec-decode counts to the totals
        ``get_stats`` reports."""
        if stats is None:
            return
        step_spec, spec = stats.spec_decoding_stats, self.spec_decoding_stats
        if step_spec is not None:
            spec.num_drafts += step_spec.num_drafts
            spec.num_draft_tokens += step_spec.num_draft_tokens
            spec.num_accepted_tokens += step_spec.num_accepted_tokens
            for pos, n in enumerate(step_spec.num_accepted_tokens_per_pos):
                spec.num_accepted_tokens_per_pos[pos] += n
        total, new = self.prefix_cache_stats, stats.prefix_cache_stats
        total.requests += new.requests
        total.queries += new.queries
        total.hits += new.hits
        total.preempted_requests += new.preempted_requests
        total.preempted_queries += new.preempted_queries
        total.preempted_hits += new.preempted_hits

    def start_profile(self, profile_prefix: str | None = None) -> None:
        """Start the torch profiler (llm_engine.py:327); needs a ProfilerConfig."""
        self.engine_core.profile(True, profile_prefix)

    def stop_profile(self) -> None:
        """Stop it and write the trace."""
        self.engine_core.profile(False)

    def get_stats(self) -> dict:
        """Totals since start: steps, preemptions, tokens, prefix-cache hits,
        drafts (verified drafts, their tokens, accepted tokens, accepted per
        draft position)."""
        core = self.engine_core
        return {
            "num_gpu_blocks": self.vllm_config.cache_config.num_gpu_blocks,
            "num_steps": core.num_steps,
            "num_preemptions": core.num_preemptions,
            "num_scheduled_tokens": core.num_scheduled_tokens,
            "prefix_cache_queries": self.prefix_cache_stats.queries,
            "prefix_cache_hits": self.prefix_cache_stats.hits,
            "model_forward_seconds": core.model_runner.forward_time,
            "spec_num_drafts": self.spec_decoding_stats.num_drafts,
            "spec_num_draft_tokens": self.spec_decoding_stats.num_draft_tokens,
            "spec_num_accepted_tokens": self.spec_decoding_stats.num_accepted_tokens,
            "spec_num_accepted_tokens_per_pos": list(
                self.spec_decoding_stats.num_accepted_tokens_per_pos
            ),
        }
