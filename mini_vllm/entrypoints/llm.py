"""``LLM``: the offline entrypoint — load a model, generate for a list of prompts.

Mirrors upstream ``vllm/entrypoints/llm.py`` (``LLM`` :66: ``__init__`` :176,
``generate`` :422, ``chat`` :615) at v0.22.1. Left out: beam search, pooling/embedding
tasks, LoRA, multimodal inputs, pipeline parallelism, most engine arguments.
``tensor_parallel_size`` and ``distributed_executor_backend`` (upstream's
names) run the model split over that many worker processes
(executor/multiproc_executor.py); a worker that fails ends the engine.

Differences: the KV cache is sized from ``kv_cache_memory_bytes`` or
``num_gpu_blocks_override`` when given; on a CPU without either, mini_vllm
takes 1 GiB (upstream's CPU backend has its own knob,
VLLM_CPU_KVCACHE_SPACE), because a fraction of all RAM is not a sensible
default for a laptop.

Failures: ``generate`` aborts every request it added on *any* exception,
Ctrl-C (KeyboardInterrupt) and a failed step included, and drops their
blocks from the prefix cache (``LLMEngine.fail_requests``), so the ``LLM``
stays usable and every block returns to the pool. Upstream aborts only on
an ``Exception`` while adding requests (vllm/entrypoints/offline_utils.py:545), and its
engine dies on a failed step. One ``generate`` runs at a time: a second
thread calling it gets a RuntimeError instead of sharing the engine's loop.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence

import torch

from mini_vllm.config import (
    AttentionConfig,
    CacheConfig,
    CompilationConfig,
    CompilationMode,
    DeviceConfig,
    KVTransferConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    ProfilerConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
    verify_logprobs_mode,
)
from mini_vllm.engine.llm_engine import (
    LLMEngine,
    resolve_attention_backend,
    resolve_device,
    resolve_dtype,
    verify_kv_cache_dtype,
)
from mini_vllm.entrypoints.chat_utils import parse_chat_messages
from mini_vllm.executor.multiproc_executor import WorkerFailedError
from mini_vllm.lora.request import LoRARequest
from mini_vllm.outputs import RequestOutput
from mini_vllm.sampling_params import SamplingParams

CPU_DEFAULT_KV_CACHE_BYTES = 1 << 30


def default_batch_limits(device) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) for offline use, as upstream's
    EngineArgs picks them for the LLM class (vllm/engine/arg_utils.py:2311)."""
    if device.type == "cpu":
        return 4096, 256
    total = torch.cuda.get_device_properties(device).total_memory
    name = torch.cuda.get_device_name(device).lower()
    if total >= 70 * 2**30 and "a100" not in name:
        return 16384, 1024
    return 8192, 256


def compilation_config_of(value: int | dict | CompilationConfig | None) -> CompilationConfig:
    """``LLM``'s ``compilation_config``: an int is the mode, a dict the fields
    (upstream's rule, entrypoints/llm.py:275-282); checked here, before loading."""
    if isinstance(value, CompilationConfig):
        config = value
    elif isinstance(value, dict):
        config = CompilationConfig(**value)
    elif value is None:
        config = CompilationConfig()
    elif isinstance(value, int):
        config = CompilationConfig(mode=CompilationMode(value) if 0 <= value <= 3 else value)
    else:
        raise ValueError(f"compilation_config must be an int, a dict or None, got {value!r}.")
    config.verify()
    return config


class LLM:
    def __init__(
        self,
        model: str,
        *,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        enable_chunked_prefill: bool = True,
        enable_prefix_caching: bool = True,
        long_prefill_token_threshold: int = 0,
        block_size: int = 16,
        gpu_memory_utilization: float = 0.9,
        kv_cache_memory_bytes: int | None = None,
        num_gpu_blocks_override: int | None = None,
        num_cpu_blocks: int | None = None,
        scheduler_cls: type | str | None = None,
        policy: str = "fcfs",
        async_scheduling: bool = False,
        device: str = "auto",
        dtype: str = "auto",
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        attention_backend: str = "auto",
        seed: int = 0,
        max_logprobs: int = 20,
        logits_processors: list[type] | None = None,
        logprobs_mode: str = "raw_logprobs",
        speculative_config: dict | None = None,
        kv_transfer_config: dict | None = None,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        tensor_parallel_size: int = 1,
        distributed_executor_backend: str | None = None,
        enable_prompt_embeds: bool = False,
        profiler_config: dict | None = None,
        enforce_eager: bool = False,
        compilation_config: int | dict | CompilationConfig | None = None,
    ) -> None:
        from mini_vllm.model_executor.layers.quantization import verify_quantization
        from mini_vllm.model_executor.model_loader import find_checkpoint, load_model

        # Checked before minutes of loading, not after.
        verify_logprobs_mode(logprobs_mode)
        verify_quantization(quantization)
        CacheConfig(cache_dtype=kv_cache_dtype).verify()
        # e.g. {"profiler": "torch", "torch_profiler_dir": "/tmp/traces"}, as upstream's.
        profiler = ProfilerConfig(**(profiler_config or {}))
        profiler.verify()
        parallel_config = ParallelConfig(tensor_parallel_size, distributed_executor_backend)
        lora_config = None
        if enable_lora:  # upstream's EngineArgs: a LoRAConfig only with enable_lora
            lora_config = LoRAConfig(max_lora_rank, max_loras, max_cpu_loras)
            lora_config.verify()
        # e.g. {"method": "ngram", "num_speculative_tokens": 3,
        # "prompt_lookup_min": 2, "prompt_lookup_max": 4}, as upstream's.
        spec_config = (
            None if speculative_config is None else SpeculativeConfig.from_dict(speculative_config)
        )
        # e.g. {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
        # "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}.
        kv_config = (
            None if kv_transfer_config is None else KVTransferConfig.from_dict(kv_transfer_config)
        )
        compilation = compilation_config_of(compilation_config)
        torch_device = resolve_device(device)
        verify_kv_cache_dtype(
            kv_cache_dtype, resolve_attention_backend(attention_backend, torch_device)
        )
        if quantization == "gguf":  # needs a GGUF file: checked before reading it
            verify_quantization(quantization, find_checkpoint(model)[0])
        loaded = load_model(
            model,
            device=torch_device,
            dtype=resolve_dtype(dtype, torch_device),
            quantization=quantization,
        )
        if max_model_len is None:
            max_model_len = int(loaded.hf_config.get_text_config().max_position_embeddings)
        default_tokens, default_seqs = default_batch_limits(torch_device)
        if max_num_seqs is None:
            max_num_seqs = default_seqs
        if max_num_batched_tokens is None:
            max_num_batched_tokens = default_tokens
            if not enable_chunked_prefill:
                max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)
            max_num_batched_tokens = max(max_num_batched_tokens, max_num_seqs)
        if (
            kv_cache_memory_bytes is None
            and num_gpu_blocks_override is None
            and torch_device.type == "cpu"
        ):
            kv_cache_memory_bytes = CPU_DEFAULT_KV_CACHE_BYTES
        config = VllmConfig(
            model_config=ModelConfig(
                max_model_len=max_model_len,
                model=model,
                dtype=dtype,
                quantization=quantization,
                seed=seed,
                max_logprobs=max_logprobs,
                logits_processors=logits_processors,
                logprobs_mode=logprobs_mode,
                enable_prompt_embeds=enable_prompt_embeds,
                enforce_eager=enforce_eager,
            ),
            cache_config=CacheConfig(
                block_size=block_size,
                enable_prefix_caching=enable_prefix_caching,
                gpu_memory_utilization=gpu_memory_utilization,
                kv_cache_memory_bytes=kv_cache_memory_bytes,
                num_gpu_blocks_override=num_gpu_blocks_override,
                cache_dtype=kv_cache_dtype,
                num_cpu_blocks=num_cpu_blocks,  # the swap space (Phase 19's SwapScheduler)
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                enable_chunked_prefill=enable_chunked_prefill,
                long_prefill_token_threshold=long_prefill_token_threshold,
                policy=policy,
                scheduler_cls=scheduler_cls,
                async_scheduling=async_scheduling,
            ),
            device_config=DeviceConfig(device=device),
            attention_config=AttentionConfig(backend=attention_backend),
            speculative_config=spec_config,
            kv_transfer_config=kv_config,
            lora_config=lora_config,
            parallel_config=parallel_config,
            profiler_config=profiler,
            compilation_config=compilation,
        )
        self.llm_engine = LLMEngine(config, loaded)
        self.request_counter = itertools.count()
        self._generate_lock = threading.Lock()

    def start_profile(self, profile_prefix: str | None = None) -> None:
        """Record every torch op of the steps that follow, until ``stop_profile``
        writes the Chrome trace under ``profiler_config``'s ``torch_profiler_dir``
        (upstream: entrypoints/llm.py:786). ``profile_prefix`` starts the file's name."""
        self.llm_engine.start_profile(profile_prefix)

    def stop_profile(self) -> None:
        self.llm_engine.stop_profile()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        ``prompts``: a string, a ``{"prompt_token_ids": [...]}`` dict, or a
        list of either; for a multimodal model (Phase 13) a dict may carry
        images: ``{"prompt": "USER: <image>\\n...", "multi_modal_data":
        {"image": pil_image_or_list}}``, one ``<image>`` per image.
        ``sampling_params``: one for all, or one per prompt; ``lora_request``
        too (None: the base model; needs ``enable_lora``).
        A prompt that is rejected raises before anything runs. On any
        exception (Ctrl-C included) every request of this call is aborted.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(
                f"prompts must be a string, a prompt dict or a list of them, got "
                f"{type(prompts).__name__}."
            )
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params.")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_request = [lora_request] * len(prompts)
        if len(lora_request) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(lora_request)} lora requests.")
        if not self._generate_lock.acquire(blocking=False):
            raise RuntimeError(
                "LLM.generate is already running in another thread: an LLM runs one "
                "generate() at a time. Wait for it, or give each thread its own LLM."
            )
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for prompt, params, lora in zip(prompts, sampling_params, lora_request, strict=True):
                ids.append(str(next(self.request_counter)))
                engine.add_request(ids[-1], prompt, params, lora_request=lora)
            return self._run_engine(ids, use_tqdm)
        except BaseException as e:
            # The ids include one whose add_request was cut short: the engine
            # ignores ids it does not know.
            engine.fail_requests(ids)
            if not isinstance(e, (ValueError, TypeError, WorkerFailedError)) and ids:
                e.add_note(
                    f"mini_vllm: generate() aborted its {len(ids)} requests and freed "
                    "their KV blocks; the LLM is ready for the next call."
                )
            raise
        finally:
            self._generate_lock.release()

    def chat(
        self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them,
        rendered with the model's chat template.

        Every message is checked first (``chat_utils.parse_chat_messages``,
        upstream's rules): a malformed one raises a ValueError naming it
        before any template runs; ``content`` None or missing is "".
        """
        tokenizer = self.get_tokenizer()
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("This model has no chat template.")
        if not isinstance(messages, list):
            raise ValueError(
                "messages must be a list of message dicts (one conversation) or a list of "
                f"such lists, got {type(messages).__name__}."
            )
        # upstream's conversation_to_seq (vllm/renderers/inputs/preprocess.py:59)
        if messages and isinstance(messages[0], dict):
            messages = [messages]
            wheres = ["messages"]
        else:
            wheres = [f"messages[{c}]" for c in range(len(messages))]
        # A multimodal model takes image_url parts (data URLs): each
        # conversation's images go with its prompt.
        # Every conversation is checked before any template runs.
        multimodal = self.llm_engine.mm_processor is not None
        images = [[] if multimodal else None for _ in messages]
        conversations = [
            parse_chat_messages(conv, where, images=conv_images)
            for conv, where, conv_images in zip(messages, wheres, images, strict=True)
        ]
        prompts = []
        for conv, conv_images in zip(conversations, images, strict=True):
            prompt: dict = {
                "prompt_token_ids": tokenizer.apply_chat_template(
                    conv, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            }
            if conv_images:
                prompt["multi_modal_data"] = {"image": conv_images}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run_engine(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        start = time.perf_counter()
        num_out = 0
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        num_out += len(output.outputs[0].token_ids)
                        if bar is not None:
                            bar.update(1)
                            elapsed = time.perf_counter() - start
                            bar.set_postfix_str(f"output {num_out / max(elapsed, 1e-9):.1f} tok/s")
        finally:
            if bar is not None:
                bar.close()
        return [finished[i] for i in ids]
