"""Engine configuration: the subset of upstream's config classes mini_vllm uses.

Mirrors upstream ``vllm/config/`` at v0.22.1: ``SchedulerConfig``
(config/scheduler.py; validation in ``verify_max_model_len`` at :259),
``CacheConfig`` (config/cache.py), ``ModelConfig`` (config/model.py),
``DeviceConfig`` (config/device.py), ``AttentionConfig``
(config/attention.py), ``SpeculativeConfig`` (config/speculative.py:74, the
n-gram method only), ``LoRAConfig`` (config/lora.py:31), ``KVTransferConfig``
(config/kv_transfer.py:23, the fields a connector reads), ``ParallelConfig``
(config/parallel.py:108: tensor parallelism and the executor only),
``CompilationMode`` (config/compilation.py:37), ``CUDAGraphMode``
(config/compilation.py:53), ``CompilationConfig`` (config/compilation.py:381:
mode, backend, inductor options, cache folder, CUDA graphs), ``ProfilerConfig``
(config/profiler.py:34: the torch profiler's switch, folder and trace
options) and ``VllmConfig`` (config/vllm.py).
Defaults are upstream's. ``ModelConfig`` here holds only ``max_model_len``, the model
path, dtype, ``quantization``, seed, ``max_logprobs``, ``logits_processors``, ``logprobs_mode``
and ``mm_max_tokens_per_item`` (what upstream's processor reports for a multimodal model)
(upstream checks its four values with pydantic; mini with
``verify_logprobs_mode``); its ``verify_max_model_len`` is the check at
the end of upstream's ``_get_and_verify_max_len`` (config/model.py:2119).
Left out: pipeline, data and expert parallelism, LoRA's dtype and module
filters, draft-model and EAGLE speculation, KV-transfer networking fields
(engine id, ports, buffers), compilation's passes, piecewise splitting and
compile sizes, observability, partial-prefill
limits.
"""

from __future__ import annotations

import enum
import os
import uuid
from dataclasses import dataclass, field, fields

# Upstream's LogprobsMode (vllm/config/model.py:98): what a returned logprob holds.
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


def verify_logprobs_mode(mode: str) -> None:
    """A ValueError naming the field unless ``mode`` is one of upstream's four."""
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {mode!r}.")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # 0 = off; otherwise no request gets more than this many tokens a step.
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    # Admit a waiting request only if its whole prompt fits in free blocks.
    scheduler_reserve_full_isl: bool = True
    # Class to instantiate instead of mini_vllm's Scheduler (labs plug in here).
    scheduler_cls: type | str | None = None
    # Schedule step N+1 while step N runs (AsyncScheduler and the engine
    # core's batch queue). Upstream resolves its default to True; here False.
    async_scheduling: bool = False
    # The encoder budgets of a multimodal model, in encoder embeddings: how
    # many one step may compute, and how many the runner's encoder cache
    # holds (config/scheduler.py:96, :103). Upstream always sets both to
    # max_num_batched_tokens (:235-236); mini_vllm does when they are None,
    # and lets them be set (tests and labs use tight budgets).
    max_num_encoder_input_tokens: int | None = None
    encoder_cache_size: int | None = None
    # Never cut a multimodal item's placeholders between two steps (:117).
    disable_chunked_mm_input: bool = False

    def __post_init__(self) -> None:
        if self.max_num_encoder_input_tokens is None:
            self.max_num_encoder_input_tokens = self.max_num_batched_tokens
        if self.encoder_cache_size is None:
            self.encoder_cache_size = self.max_num_batched_tokens

    def verify(self, max_model_len: int) -> None:
        for name in ("max_num_encoder_input_tokens", "encoder_cache_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}."
            )
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(
                f"async_scheduling must be True or False, got {self.async_scheduling!r}."
            )
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be >= 0, got "
                f"{self.long_prefill_token_threshold}."
            )
        if self.max_num_batched_tokens < max_model_len and not self.enable_chunked_prefill:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({max_model_len}) and chunked prefill is off, so a long "
                "prompt could never be scheduled. Increase max_num_batched_tokens, "
                "decrease max_model_len, or enable chunked prefill."
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be greater "
                f"than or equal to max_num_seqs ({self.max_num_seqs})."
            )
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(
                f"Unknown scheduling policy: {self.policy!r} (use 'fcfs' or 'priority')."
            )


@dataclass
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    # Set at start-up from the memory budget (or given directly in tests).
    num_gpu_blocks: int | None = None
    # KV-cache budget, in order of precedence: a block count, bytes, or a
    # fraction of device memory.
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    # The KV cache's dtype (upstream's name and values; LLM(kv_cache_dtype=...)):
    # "auto" = the model's; "fp8" / "fp8_e4m3" = e4m3, one byte a value.
    cache_dtype: str = "auto"
    # Blocks of the CPU swap space: only Phase 19's SwapScheduler (vLLM v0's
    # swapping) uses it. Upstream keeps the field (vllm/config/cache.py:145)
    # but v1 never swaps.
    num_cpu_blocks: int | None = None
    # The fraction of GPU blocks SwapScheduler keeps free when it admits or
    # swaps in a request while others run (vLLM v0's block manager
    # ``watermark``, default 0.01; v1's CacheConfig has no such field).
    watermark: float = 0.01

    def verify(self) -> None:
        from mini_vllm.utils.torch_utils import KV_CACHE_DTYPES

        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.cache_dtype!r}."
            )
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}.")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}."
            )
        if self.num_cpu_blocks is not None and self.num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {self.num_cpu_blocks}.")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}.")


@dataclass
class ModelConfig:
    max_model_len: int = 2048
    model: str | None = None
    # "auto" = float32 on CPU, bfloat16 on CUDA; or "float32"/"float16"/"bfloat16".
    dtype: str = "auto"
    # None, or a method of model_executor/layers/quantization (upstream's names).
    # Upstream forces "gguf" for a GGUF model; mini_vllm's None dequantizes it at load.
    quantization: str | None = None
    seed: int = 0
    # Accept prompts given as embeddings, {"prompt_embeds": [T, hidden]}
    # (upstream's enable_prompt_embeds, vllm/config/model.py:266).
    enable_prompt_embeds: bool = False
    # Most logprobs a request may ask for (upstream's default, 20; -1: no cap).
    max_logprobs: int = 20
    # Custom logits processor classes, run after the built-ins (upstream's
    # field also takes qualified names; mini_vllm takes classes only).
    logits_processors: list[type] | None = None
    # What logprobs hold (upstream's LogprobsMode, vllm/config/model.py:98):
    # raw_logprobs (the default), raw_logits, processed_logprobs, processed_logits.
    logprobs_mode: str = "raw_logprobs"
    # Run every step eagerly: no CUDA graphs and no torch.compile (upstream's
    # field, vllm/config/model.py:227).
    enforce_eager: bool = False
    # A multimodal model's most encoder embeddings per item, by modality
    # ({"image": 576}); None for a text model. Upstream asks the model's
    # processor (MultiModalBudget, vllm/multimodal/encoder_budget.py:117);
    # mini_vllm's model loader sets it. The scheduler's encoder budgets
    # come from it (core/encoder_cache_manager.compute_mm_encoder_budget).
    mm_max_tokens_per_item: dict[str, int] | None = None

    def verify(self) -> None:
        from mini_vllm.model_executor.layers.quantization import verify_quantization

        verify_logprobs_mode(self.logprobs_mode)
        verify_quantization(self.quantization)
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}.")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(
                f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}."
            )

    def verify_with_parallel_config(self, hf_config, parallel_config) -> None:
        """Refuse, before any worker starts, a model that ``tensor_parallel_size``
        cannot split: upstream's check of the attention heads (config/model.py:1191),
        then what its layers would assert later (KV heads, MLP, padded vocabulary)."""
        tp = parallel_config.tensor_parallel_size
        if tp == 1:
            return
        if getattr(hf_config, "vision_config", None) is not None:
            raise ValueError(
                f"tensor_parallel_size={tp}: mini_vllm runs a vision-language model on one "
                "rank only (its vision tower is not split); use tensor_parallel_size=1."
            )
        heads = hf_config.num_attention_heads
        if heads % tp != 0:
            raise ValueError(
                f"Total number of attention heads ({heads}) must be divisible by tensor "
                f"parallel size ({tp})."
            )
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        if kv_heads % tp != 0 and tp % kv_heads != 0:
            raise ValueError(
                f"Total number of KV heads ({kv_heads}) must divide, or be divisible by, "
                f"tensor parallel size ({tp})."
            )
        inter = getattr(hf_config, "intermediate_size", 0)
        if inter % tp != 0:
            raise ValueError(
                f"intermediate_size ({inter}) must be divisible by tensor parallel size ({tp})."
            )
        padded = (hf_config.vocab_size + 63) // 64 * 64
        if tp > 1 and padded % tp != 0:
            raise ValueError(
                f"The vocabulary ({hf_config.vocab_size}, padded to {padded}) must be "
                f"divisible by tensor parallel size ({tp})."
            )

    def verify_max_model_len(self, hf_config) -> None:
        """Refuse a max_model_len beyond the model's max_position_embeddings,
        as upstream's ``_get_and_verify_max_len`` (config/model.py:2119) does.
        Upstream lets VLLM_ALLOW_LONG_MAX_MODEL_LEN override it; mini_vllm has
        no override, since its rotary cache stops at that length."""
        derived = getattr(hf_config.get_text_config(), "max_position_embeddings", None)
        if derived is not None and self.max_model_len > derived:
            raise ValueError(
                f"User-specified max_model_len ({self.max_model_len}) is greater than the "
                f"derived max_model_len (max_position_embeddings={derived} in the model's "
                "config.json): the model has no position embedding past it. "
                "Lower max_model_len."
            )


@dataclass
class DeviceConfig:
    # "auto" = cuda when available, else cpu.
    device: str = "auto"

    def verify(self) -> None:
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}.")


class CUDAGraphMode(enum.Enum):
    """How the model's forward may run from CUDA graphs (upstream's enum,
    config/compilation.py:53). NONE, PIECEWISE and FULL are also the modes a
    single step runs in; the two tuple modes name a decode mode and a mode
    for everything else ("mixed" batches): (decode, mixed)."""

    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (FULL, NONE)
    FULL_AND_PIECEWISE = (FULL, PIECEWISE)

    def separate_routine(self) -> bool:
        """True for the tuple modes: decode batches get a mode of their own."""
        return isinstance(self.value, tuple)

    def decode_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(self.value[0]) if self.separate_routine() else self

    def mixed_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(self.value[1]) if self.separate_routine() else self

    def has_mode(self, mode: CUDAGraphMode) -> bool:
        """Whether this mode ever runs a step in the runtime ``mode``."""
        assert not mode.separate_routine()
        if self.separate_routine():
            return mode.value in self.value
        return self == mode

    @classmethod
    def valid_runtime_modes(cls) -> frozenset[CUDAGraphMode]:
        return frozenset({cls.NONE, cls.PIECEWISE, cls.FULL})

    def __bool__(self) -> bool:
        return self != CUDAGraphMode.NONE


class CompilationMode(enum.IntEnum):
    """How the model is compiled (upstream's enum, config/compilation.py:37).
    NONE: eager. STOCK_TORCH_COMPILE: plain ``torch.compile`` of the model,
    guards kept (not in mini_vllm). DYNAMO_TRACE_ONCE: one Dynamo trace of
    the model with its batch dimension dynamic, guards dropped, so no batch
    size recompiles. VLLM_COMPILE: upstream's piecewise inductor backend;
    on a CPU upstream turns it into DYNAMO_TRACE_ONCE (platforms/cpu.py:169-188)
    and so does mini_vllm, on every device."""

    NONE = 0
    STOCK_TORCH_COMPILE = 1
    DYNAMO_TRACE_ONCE = 2
    VLLM_COMPILE = 3


# The inductor options upstream's CPU platform sets (platforms/cpu.py:181-188).
CPU_INDUCTOR_COMPILE_CONFIG = {
    "dce": True,
    "size_asserts": False,
    "nan_asserts": False,
    "epilogue_fusion": True,
    "cpp.dynamic_threads": True,
}


@dataclass
class CompilationConfig:
    """Upstream's CompilationConfig (config/compilation.py:381): the
    torch.compile fields (``mode``, ``backend``, ``inductor_compile_config``,
    ``cache_dir``) and the CUDA-graph ones.

    Compilation: upstream's default mode on a CPU is VLLM_COMPILE, which its
    CPU platform makes DYNAMO_TRACE_ONCE with the inductor backend.
    mini_vllm's default is NONE (eager): the readable path, and compile does
    not pay at mini_vllm's scale. The compiled graph keeps the eager path's
    packed oneDNN matmul (one opaque op), so only the elementwise work
    changes: on SmolLM2 (fp32, 1 thread, the roofline benchmark's 128
    requests) compiled took 1.01x eager's CPU time, level, after a compile
    run of about two minutes (the conditions are in
    mini_vllm/benchmarks/README.md and UPSTREAM_PIN.md, Phase 18). Ask for it with
    ``LLM(..., compilation_config={"mode": 3})`` (or 2). ``cache_dir``, when
    set, is where inductor keeps its compiled kernels (upstream points
    TORCHINDUCTOR_CACHE_DIR at its cache, compilation/decorators.py:558), so a second
    engine start reuses them.

    CUDA graphs: upstream's default mode is FULL_AND_PIECEWISE; mini_vllm has
    no piecewise graphs, so its default is FULL_DECODE_ONLY: full graphs of
    decode-only batches, every other step eager. The sizes are filled in by
    ``VllmConfig._set_cudagraph_sizes`` (upstream's, config/vllm.py:1597)."""

    # NONE (mini_vllm's default), DYNAMO_TRACE_ONCE or VLLM_COMPILE (an int is taken too).
    mode: CompilationMode = CompilationMode.NONE
    # "" (inductor), "inductor" or "eager" (Dynamo's trace, run without inductor).
    backend: str = ""
    # Options handed to inductor; the CPU platform's are added (CPU_INDUCTOR_COMPILE_CONFIG).
    inductor_compile_config: dict = field(default_factory=dict)
    # Inductor's on-disk cache; "" leaves torch's default (/tmp/torchinductor_$USER).
    cache_dir: str = ""
    cudagraph_mode: CUDAGraphMode = CUDAGraphMode.FULL_DECODE_ONLY
    # Batch sizes (in tokens) to capture; None: upstream's default list.
    cudagraph_capture_sizes: list[int] | None = None
    # The largest size to capture; None: min(2 * max_num_seqs * decode query
    # length, 512), then at most max_num_batched_tokens.
    max_cudagraph_capture_size: int | None = None

    def verify(self) -> None:
        if not isinstance(self.mode, CompilationMode):
            try:
                self.mode = CompilationMode(self.mode)
            except ValueError:
                raise ValueError(
                    f"compilation mode must be a CompilationMode (0-3), got {self.mode!r}."
                ) from None
        if self.mode == CompilationMode.STOCK_TORCH_COMPILE:
            raise ValueError(
                "compilation mode STOCK_TORCH_COMPILE is not supported by mini_vllm: "
                "use DYNAMO_TRACE_ONCE (2), VLLM_COMPILE (3) or NONE (0)."
            )
        if self.backend not in ("", "inductor", "eager"):
            raise ValueError(
                f"compilation backend must be '', 'inductor' or 'eager', got {self.backend!r}."
            )
        if not isinstance(self.cudagraph_mode, CUDAGraphMode):
            raise ValueError(
                f"cudagraph_mode must be a CUDAGraphMode, got {self.cudagraph_mode!r}."
            )
        sizes = self.cudagraph_capture_sizes
        if sizes is not None and (not sizes or any(int(n) != n or n < 1 for n in sizes)):
            raise ValueError(
                f"cudagraph_capture_sizes must be a non-empty list of positive ints, got {sizes!r}."
            )
        top = self.max_cudagraph_capture_size
        if top is not None and top < 1:
            raise ValueError(f"max_cudagraph_capture_size must be at least 1, got {top}.")


@dataclass
class ProfilerConfig:
    # "torch" (the torch profiler) or None (off). Upstream also has "cuda" (nsys).
    profiler: str | None = None
    # Where traces go; required with "torch" (made absolute).
    torch_profiler_dir: str = ""
    torch_profiler_with_stack: bool = True
    torch_profiler_use_gzip: bool = True
    torch_profiler_record_shapes: bool = False

    def verify(self) -> None:
        """Upstream's checks (config/profiler.py:126), in its words."""
        if self.profiler not in (None, "torch"):
            raise ValueError(f"profiler must be 'torch' or None, got {self.profiler!r}.")
        if self.torch_profiler_dir and self.profiler != "torch":
            raise ValueError(
                "torch_profiler_dir is only applicable when profiler is set to 'torch'"
            )
        if self.profiler == "torch" and not self.torch_profiler_dir:
            raise ValueError("torch_profiler_dir must be set when profiler is 'torch'")
        if self.torch_profiler_dir:
            self.torch_profiler_dir = os.path.abspath(os.path.expanduser(self.torch_profiler_dir))


@dataclass
class AttentionConfig:
    # "auto" = triton on CUDA, cpu on CPU; or "cpu" / "torch" / "triton".
    backend: str = "auto"

    def verify(self) -> None:
        if self.backend not in ("auto", "cpu", "torch", "triton"):
            raise ValueError(
                f"attention backend must be auto, cpu, torch or triton, got {self.backend!r}."
            )


@dataclass
class SpeculativeConfig:
    """N-gram (prompt-lookup) speculation: after each step, draft up to
    ``num_speculative_tokens`` tokens per decoding request by matching the
    context's last ``prompt_lookup_min..prompt_lookup_max`` tokens earlier in
    the context. As upstream, a missing lookup bound takes the other's value,
    and both default to 5 (vllm/config/speculative.py:586-604)."""

    method: str = "ngram"
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None

    def __post_init__(self) -> None:
        # Check the given bounds before one is copied into the other, so that
        # an error names the field that was set.
        self._verify_ints(allow_none=True)
        if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
            self.prompt_lookup_min = self.prompt_lookup_max = 5
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min

    @classmethod
    def from_dict(cls, config: object) -> SpeculativeConfig:
        """``LLM(speculative_config={...})``: a dict of these fields, and
        nothing else (upstream's other fields serve drafters mini_vllm lacks).
        Checked here, so that a bad value fails before the model loads."""
        names = [f.name for f in fields(cls)]
        if not isinstance(config, dict):
            raise ValueError(
                f"speculative_config must be a dict with keys from {names}, "
                f"got {type(config).__name__}."
            )
        unknown = sorted(set(config) - set(names))
        if unknown:
            raise ValueError(
                f"speculative_config has unsupported keys {unknown}; mini_vllm knows {names}."
            )
        spec = cls(**config)
        spec.verify()
        return spec

    def verify(self) -> None:
        """Each field's type, then its range, in one line naming the field.

        Upstream's pydantic checks the same bounds (num_speculative_tokens
        > 0, each lookup bound >= 1: vllm/config/speculative.py:80, :140,
        :143) but coerces "3", 3.0 and True to ints; mini_vllm refuses
        anything that is not an int, as its SamplingParams does."""
        if self.method != "ngram":
            raise ValueError(
                "speculative_config.method must be 'ngram' (the only method mini_vllm "
                f"has), got {self.method!r}."
            )
        if self.num_speculative_tokens is None:
            raise ValueError(
                "speculative_config.num_speculative_tokens is required (an integer >= 1)."
            )
        self._verify_ints(allow_none=False)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})."
            )

    def _verify_ints(self, allow_none: bool) -> None:
        """Each integer field is an int >= 1 (or None while defaults are unset)."""
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if value is None and allow_none:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(
                    f"speculative_config.{name} must be an integer, got "
                    f"{type(value).__name__} {value!r}."
                )
            if value < 1:
                raise ValueError(f"speculative_config.{name} must be at least 1, got {value}.")


# Upstream's MaxLoRARanks (vllm/config/lora.py:26): the ranks a server may be sized for.
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass
class LoRAConfig:
    """How many adapters, and how large, the engine serves (``enable_lora``).

    ``max_loras``: distinct adapters in one step (the GPU slots);
    ``max_cpu_loras``: adapters kept loaded in host memory (None: max_loras,
    as upstream's ``_validate_lora_config``, vllm/config/lora.py:109);
    ``max_lora_rank``: the largest rank an adapter may have."""

    max_lora_rank: int = 16
    max_loras: int = 1
    max_cpu_loras: int | None = None

    def verify(self) -> None:
        if self.max_lora_rank not in MAX_LORA_RANKS:
            raise ValueError(
                f"max_lora_rank must be one of {MAX_LORA_RANKS}, got {self.max_lora_rank!r}."
            )
        for name in ("max_loras", "max_cpu_loras"):
            value = getattr(self, name)
            if name == "max_cpu_loras" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})."
            )


# Upstream's KVRole (vllm/config/kv_transfer.py:11-13).
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


@dataclass
class KVTransferConfig:
    """Which KV connector to run and in which role (upstream's
    vllm/config/kv_transfer.py:23). ``kv_connector`` is a registered name
    (mini_vllm/distributed/kv_transfer/kv_connector/factory.py) or, with
    ``kv_connector_module_path``, a class name in that module.
    ``kv_load_failure_policy``: what a block that failed to load does to its
    request: "fail" it (upstream's default) or "recompute" the lost tokens."""

    kv_connector: str | None = None
    # Names this engine to its peers (P/D); a fresh uuid when not given.
    engine_id: str | None = None
    kv_role: str | None = None
    kv_connector_extra_config: dict = field(default_factory=dict)
    kv_connector_module_path: str | None = None
    kv_load_failure_policy: str = "fail"

    def __post_init__(self) -> None:
        if self.engine_id is None:
            self.engine_id = str(uuid.uuid4())
        # Upstream's checks (kv_transfer.py:93-108), one line naming the field.
        if self.kv_role is not None and self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}.")
        if self.kv_connector is not None and self.kv_role is None:
            raise ValueError(f"kv_role must be set when kv_connector is ({', '.join(KV_ROLES)}).")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(
                "kv_load_failure_policy must be 'recompute' or 'fail', got "
                f"{self.kv_load_failure_policy!r}."
            )

    @classmethod
    def from_dict(cls, config: object) -> KVTransferConfig:
        """``LLM(kv_transfer_config={...})``: a dict of these fields only."""
        names = [f.name for f in fields(cls)]
        if isinstance(config, cls):
            return config
        if not isinstance(config, dict):
            raise ValueError(
                f"kv_transfer_config must be a dict with keys from {names}, "
                f"got {type(config).__name__}."
            )
        unknown = sorted(set(config) - set(names))
        if unknown:
            raise ValueError(
                f"kv_transfer_config has unsupported keys {unknown}; mini_vllm knows {names}."
            )
        return cls(**config)

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key, default):
        return self.kv_connector_extra_config.get(key, default)


# Upstream's DistributedExecutorBackend (vllm/config/parallel.py:35), less
# "external_launcher".
EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass
class ParallelConfig:
    """How many processes run the model (upstream's ``ParallelConfig``,
    vllm/config/parallel.py:108). ``distributed_executor_backend`` None
    becomes "uni" for one process and "mp" (one worker process a rank) for
    more, as upstream resolves it on one machine (parallel.py:835-880);
    "ray" runs the ranks as Ray actors, on one machine or a cluster."""

    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}."
            )
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "uni" if self.world_size == 1 else "mp"
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                f"got {self.distributed_executor_backend!r}."
            )
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError(
                f"distributed_executor_backend='uni' runs one process, but "
                f"tensor_parallel_size is {self.tensor_parallel_size}: use 'mp' or 'ray'."
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size


@dataclass
class VllmConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    attention_config: AttentionConfig = field(default_factory=AttentionConfig)
    speculative_config: SpeculativeConfig | None = None
    # None: LoRA is off (upstream's lora_config is None unless enable_lora).
    lora_config: LoRAConfig | None = None
    kv_transfer_config: KVTransferConfig | None = None
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    profiler_config: ProfilerConfig = field(default_factory=ProfilerConfig)

    def __post_init__(self) -> None:
        self.model_config.verify()
        self.profiler_config.verify()
        self.verify_parallel()
        if self.lora_config is not None:
            self.lora_config.verify()
        self.cache_config.verify()
        self.scheduler_config.verify(self.model_config.max_model_len)
        self.device_config.verify()
        self.attention_config.verify()
        self.compilation_config.verify()
        if self.speculative_config is not None:
            self.speculative_config.verify()
            # Upstream refuses the CPU n-gram drafter with async scheduling
            # (config/vllm.py:911-924): its drafts are needed before the next
            # schedule(), which async scheduling runs before they exist.
            if self.scheduler_config.async_scheduling:
                raise ValueError(
                    "async_scheduling=True does not work with "
                    f"speculative method {self.speculative_config.method!r}: the "
                    "n-gram drafter proposes after a step's tokens are known, and "
                    "async scheduling schedules the next step before that. Turn "
                    "one of them off."
                )
        if self.model_config.enforce_eager:  # no graphs at all (config/vllm.py:1233)
            self.compilation_config.cudagraph_mode = CUDAGraphMode.NONE
        self._set_compilation_mode()
        self._set_cudagraph_sizes()

    def _set_compilation_mode(self) -> None:
        """Upstream's rules for the compilation mode: enforce_eager turns it
        off (config/vllm.py:1032-1037); the CPU platform makes VLLM_COMPILE a
        single Dynamo trace with inductor and its options, and LoRA turns
        compilation off (platforms/cpu.py:169-196)."""
        cc = self.compilation_config
        if self.model_config.enforce_eager:
            cc.mode = CompilationMode.NONE
        if cc.mode == CompilationMode.VLLM_COMPILE:
            cc.mode = CompilationMode.DYNAMO_TRACE_ONCE
            cc.backend = cc.backend or "inductor"
            cc.inductor_compile_config.update(CPU_INDUCTOR_COMPILE_CONFIG)
        if self.lora_config is not None:
            cc.mode = CompilationMode.NONE
        if cc.mode == CompilationMode.DYNAMO_TRACE_ONCE and not cc.backend:
            cc.backend = "inductor"

    def _set_cudagraph_sizes(self) -> None:
        """The batch sizes to capture, upstream's rule (config/vllm.py:1597):
        given sizes are de-duplicated, sorted and cut at max_num_batched_tokens;
        otherwise 1, 2, 4, then every 8 below 256, then every 16, up to the
        largest size, plus max_num_batched_tokens when it fits under it.
        Left out: the "interactivity" performance mode and sequence
        parallelism's rounding. No graphs: no sizes, and a largest size of 0."""
        cc = self.compilation_config
        if self.model_config.enforce_eager or cc.cudagraph_mode == CUDAGraphMode.NONE:
            cc.max_cudagraph_capture_size = 0
            cc.cudagraph_capture_sizes = []
            return
        largest = cc.max_cudagraph_capture_size
        if largest is None:
            decode_query_len = 1
            if self.speculative_config is not None:
                decode_query_len += self.speculative_config.num_speculative_tokens
            largest = min(self.scheduler_config.max_num_seqs * decode_query_len * 2, 512)
        max_num_tokens = self.scheduler_config.max_num_batched_tokens
        largest = min(max_num_tokens, largest)

        if cc.cudagraph_capture_sizes is not None:
            sizes = sorted(n for n in set(cc.cudagraph_capture_sizes) if n <= max_num_tokens)
        else:
            sizes = [n for n in (1, 2, 4) if n <= largest]
            if largest >= 8:
                sizes += range(8, min(largest + 1, 256), 8)
            if largest >= 256:
                sizes += range(256, largest + 1, 16)
            if max_num_tokens <= largest:
                sizes.append(max_num_tokens)
            sizes = sorted(set(sizes))

        # A given largest size that disagrees with the sizes is cut to them,
        # unless both were given (then they contradict each other).
        valid_largest = sizes[-1] if sizes else 0
        given = cc.max_cudagraph_capture_size
        if given is not None and given != valid_largest and cc.cudagraph_capture_sizes is not None:
            raise ValueError(
                f"max_cudagraph_capture_size ({given}) must equal the largest of "
                f"cudagraph_capture_sizes ({valid_largest})."
            )
        cc.max_cudagraph_capture_size = valid_largest
        cc.cudagraph_capture_sizes = sizes

    def verify_parallel(self) -> None:
        """Refuse what mini_vllm's tensor parallelism does not cover (upstream
        runs all of these split): one line naming the setting."""
        if self.parallel_config.tensor_parallel_size == 1:
            return
        unsupported = {
            "quantization": self.model_config.quantization is not None,
            "LoRA": self.lora_config is not None,
            "speculative decoding": self.speculative_config is not None,
            "a KV connector": self.kv_transfer_config is not None,
            "async_scheduling": self.scheduler_config.async_scheduling,
            "torch.compile": self.compilation_config.mode != CompilationMode.NONE,
        }
        for name, used in unsupported.items():
            if used:
                raise ValueError(
                    f"tensor_parallel_size > 1 does not support {name} in mini_vllm "
                    "(see UPSTREAM_PIN.md, Phase 17)."
                )
