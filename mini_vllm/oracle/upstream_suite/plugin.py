"""A pytest plugin that runs upstream's own unit tests, unedited, on this CPU.

Used by ``python -m mini_vllm.oracle.upstream_suite`` (``make upstream-tests``)
with ``--noconftest`` (upstream's tests/conftest.py imports vllm's whole
serving stack) and ``--upstream-target``:

- ``vllm``: the tests run against the pinned vllm, to find the valid set (what
  passes on the pin on a CPU);
- ``mini_vllm``: the same tests run against mini_vllm. An import hook sees every
  ``import vllm...`` made by a module of upstream's ``tests`` package and hands
  back mini_vllm's module where mini_vllm has one (``MODULE_MAP``). A name
  mini_vllm's module lacks becomes a ``Missing`` stand-in, so the test file still
  imports and only the tests that use the name fail, saying which name. Modules
  mini_vllm does not have (the multimodal processing and registry, LoRA
  layers and Triton kernels, KV events...) stay upstream's: only
  out-of-scope tests need them.

Environment adaptations (the whole list; no test body is edited):
1. ``DeviceConfig(device="auto")`` becomes ``"cpu"``: without a GPU, upstream's
   platform detection fails ("Failed to infer device type"). vLLM's CPU platform
   is not switched on (it would change block size and caching defaults).
2. Offline, config-only models: the model ids the chosen tests name get a
   ``config.json`` in a private Hugging Face cache (``HF_HUB_CACHE`` under
   build/upstream-tests/, ``HF_HUB_OFFLINE=1``), holding the fields vllm's
   ``ModelConfig`` reads, with the published values. No weights, no tokenizer.
3. einops, which a KV-connector module on the tests' import path needs, and
   anthropic, which upstream's tests/utils.py imports, are installed from
   tests/upstream/requirements.txt (nothing to do here).
4. vllm logs to stderr; upstream's custom marks (``cpu_test``...) are registered.
5. The platform vllm finds without a GPU has no device type: tests that build
   tensors on "the platform's device" (the sampler's, the input batch's) get
   ``current_platform.device_type = "cpu"`` (so ``device_count()`` is
   torch.cpu's, 1, and they run on ``cpu:0``), and no pinned memory (pinning
   needs a CUDA driver; vLLM's CPU platform answers the same).
6. Under ``TRITON_INTERPRET=1`` (the runner sets it for the rejection
   sampler's file only: ``runner.ALONE``) the real Triton goes back into
   ``vllm.triton_utils``, where vLLM put placeholders when it found no GPU
   driver, so upstream's kernels run under Triton's interpreter.

Adapters, for ``mini_vllm`` only (they change how objects are built, never
what a test checks):
- upstream's test helpers ``create_requests``, ``create_scheduler``
  (tests/v1/core/utils.py) and ``create_scheduler_with_priority``
  (test_scheduler.py) build upstream's full config from a Hugging Face model;
  they are swapped for ``mini_vllm_create_*``, which take the same keywords
  and build mini_vllm's objects the same way (``async_scheduling`` gives its
  AsyncScheduler, ``num_speculative_tokens`` an n-gram speculative config,
  ``use_kv_connector`` a KV connector: upstream's own ``MockKVConnector``
  for a ``MockKVConfig``, mini_vllm's ExampleConnector for True).
  mini_vllm's scheduler holds no tokenizer, so ``skip_tokenizer_init``
  changes nothing; any other keyword for what mini_vllm leaves out (EC
  connectors, pipeline parallelism, another model, prompt logprobs)
  raises ``MissingInMiniVllm``. ``create_requests`` builds one image feature
  (no data) per ``mm_positions`` range, identified by ``mm_hashes_list`` or
  ``hash{i}_{j}`` as upstream's helper does, and ``disable_chunked_mm_input``
  reaches mini's scheduler (Phase 13); the ModelRunnerOutput
  and SchedulerOutput adapters pass the KV connector's fields through;
- mini_vllm's constructors take numbers where upstream's take a
  ``KVCacheConfig`` (UPSTREAM_PIN.md): ``KVCacheManager`` is built from the
  config's block count and block size and the config itself (any groups of
  one block size), ``BlockPool`` without ``hash_block_size``;
  ``cache_full_blocks`` takes upstream's ``block_size`` when it is the
  pool's; the pool's prefix cache (a dict of dicts) also answers the two
  ``BlockHashToBlockMap`` calls tests plant blocks with (``insert``,
  ``_cache``); ``new_step_starts``, a hook only upstream's Mamba manager
  acts on, does nothing;
- ``FullAttentionSpec`` and ``SlidingWindowSpec`` take upstream's extra
  fields (``page_size_padded``, ``attention_chunk_size``) while they are
  None and build mini's own spec; ``SlidingWindowManager`` and
  ``FullAttentionManager`` take upstream's extra arguments while they ask
  for nothing mini leaves out (``num_tokens_main_model`` equal to
  ``num_tokens``, no external tokens, no EAGLE, one-block alignment);
- ``Request``, ``SamplingParams``, ``ModelRunnerOutput``, ``SchedulerOutput``
  and ``CachedRequestState`` take upstream's extra keywords (``cache_salt``,
  ``prompt_logprobs``, ``pooling_params``...) while they are empty,
  and raise ``MissingInMiniVllm`` otherwise; a ``Request`` given
  ``prompt_embeds`` with ``prompt_token_ids=None`` gets mini's placeholder
  ids, zeros, as upstream's makes them;
- ``SamplingMetadata`` takes upstream's fields (``spec_token_ids`` while no
  row has drafts, upstream's thinking-budget holder while it tracks no
  request: kept for the test's helpers, never read by mini) and starts with
  no row blocked by min_tokens (mini keeps that in the metadata, upstream in
  a logits processor the tests do not build); ``SamplingParams`` reads an
  absent ``thinking_token_budget`` as None; ``InputBatch`` takes
  ``kernel_block_sizes`` equal to the block sizes (mini's kernels use the
  cache's block size);
- ``Sampler`` gets upstream's ``apply_penalties`` (mini's
  ``apply_all_penalties``) and ``apply_logits_processors`` with
  ``predict_bonus_token=False`` (mini has no drafts there);
- ``RejectionSampler.forward`` runs with the globals of the module the test
  imports (a starter re-exports the reference class, whose ``forward`` would
  call the reference's ``rejection_sample``);
- ``SamplerOutput`` takes an absent ``logprobs_tensors``;
  ``sample_recovered_tokens`` takes upstream's arguments (the lengths and
  device mini reads from the others) and draft ids of any shape, as
  upstream's kernel reads them by position;
- ``build_logitsprocs``, which mini has in its runner (without min_tokens,
  which its batch keeps), is built from mini's three built-ins in upstream's
  order for the logits-processor tests;
- ``Request`` and ``CachedRequestState`` take a ``lora_request`` (mini's
  ``LoRARequest``, Phase 11); ``generate_block_hash_extra_keys`` takes
  upstream's block range and first multimodal index and hands the index
  back (mini's has taken them itself since Phase 13; before, it took only
  the request, its one key being the adapter's name);
- names mini_vllm spells otherwise: ``apply_top_k_top_p_pytorch`` is mini's
  ``apply_top_k_top_p``, ``_find_longest_matched_ngram_and_propose_tokens``
  is ``NgramProposer(...).propose_one``; upstream's ``ConstantList`` (a
  read-only list view tests wrap lists in) and ``MultiModalKwargsItem`` (an
  item's processed tensors; scheduler-side tests hand a dummy one) stay
  upstream's;
- an adapter class counts as its mini_vllm class for ``isinstance``.

``--upstream-labs 05`` (a phase of runner.LAB_FILES) grades a student:
``from vllm.X import Name`` then gets the student's starter module where the
phase has one (built as the graders build it), while ``import vllm.X`` still
gets the reference module, whose module state (``NONE_HASH``) tests read and
reload. A starter holds a copy of ``NONE_HASH``, so its ``init_none_hash``
also re-seeds that copy; a reference function an adapter calls through a
starter runs with the starter's globals, so it reaches the student's code.
Phase 07's starters (the managers, the coordinator, the prefix cache's keys)
are wired in as its graders wire them (mini_vllm/grading/hybrid_checks.py):
a ``KVCacheManager`` with KV-cache groups gets the student's coordinator and
managers, the manager classes a test imports carry the methods the starter
re-opens on their base, and the reference ``BlockPool`` keys its prefix
cache with the student's ``make_block_hash_with_group_id``.
"""

from __future__ import annotations

import builtins
import functools
import importlib
import inspect
import json
import os
import types
from pathlib import Path

import pytest

from mini_vllm.oracle.upstream_suite.fetch import CACHE

# upstream module -> mini_vllm module with the same role.
MODULE_MAP = {
    "vllm.config": "mini_vllm.config",
    "vllm.sampling_params": "mini_vllm.sampling_params",
    "vllm.utils.hashing": "mini_vllm.utils.hashing",
    "vllm.lora.request": "mini_vllm.lora.request",
    "vllm.lora.ops.torch_ops": "mini_vllm.lora.ops.torch_ops",
    "vllm.lora.utils": "mini_vllm.lora.utils",
    "vllm.v1.request": "mini_vllm.request",
    "vllm.v1.outputs": "mini_vllm.outputs",
    "vllm.v1.engine": "mini_vllm.engine",
    "vllm.v1.metrics.stats": "mini_vllm.metrics.stats",
    "vllm.v1.kv_cache_interface": "mini_vllm.kv_cache_interface",
    "vllm.v1.core.kv_cache_utils": "mini_vllm.core.kv_cache_utils",
    "vllm.v1.core.encoder_cache_manager": "mini_vllm.core.encoder_cache_manager",
    "vllm.multimodal.inputs": "mini_vllm.multimodal.inputs",
    "vllm.v1.core.block_pool": "mini_vllm.core.block_pool",
    "vllm.v1.core.kv_cache_manager": "mini_vllm.core.kv_cache_manager",
    "vllm.v1.core.kv_cache_coordinator": "mini_vllm.core.kv_cache_coordinator",
    "vllm.v1.core.single_type_kv_cache_manager": "mini_vllm.core.single_type_kv_cache_manager",
    "vllm.v1.core.sched.output": "mini_vllm.core.sched.output",
    "vllm.v1.core.sched.request_queue": "mini_vllm.core.sched.request_queue",
    "vllm.v1.core.sched.scheduler": "mini_vllm.core.sched.scheduler",
    "vllm.v1.core.sched.utils": "mini_vllm.core.sched.utils",
    "vllm.v1.core.sched.async_scheduler": "mini_vllm.core.sched.async_scheduler",
    "vllm.v1.worker.gpu_input_batch": "mini_vllm.worker.gpu_input_batch",
    "vllm.v1.worker.block_table": "mini_vllm.worker.block_table",
    "vllm.v1.sample.metadata": "mini_vllm.sample.metadata",
    "vllm.v1.sample.sampler": "mini_vllm.sample.sampler",
    "vllm.v1.sample.rejection_sampler": "mini_vllm.sample.rejection_sampler",
    "vllm.v1.sample.logits_processor": "mini_vllm.sample.logits_processor",
    "vllm.v1.sample.logits_processor.builtin": "mini_vllm.sample.logits_processor.builtin",
    "vllm.v1.sample.ops.topk_topp_sampler": "mini_vllm.sample.ops.topk_topp_sampler",
    "vllm.v1.sample.ops.penalties": "mini_vllm.sample.ops.penalties",
    "vllm.v1.sample.ops.bad_words": "mini_vllm.sample.ops.bad_words",
    "vllm.v1.utils": "mini_vllm.utils",
    "vllm.v1.spec_decode.metadata": "mini_vllm.spec_decode.metadata",
    "vllm.v1.spec_decode.ngram_proposer": "mini_vllm.spec_decode.ngram_proposer",
    "vllm.v1.structured_output": "mini_vllm.structured_output",
    "vllm.v1.structured_output.backend_types": "mini_vllm.structured_output.backend_types",
    "vllm.v1.structured_output.backend_xgrammar": "mini_vllm.structured_output.backend_xgrammar",
    "vllm.v1.structured_output.request": "mini_vllm.structured_output.request",
    "vllm.v1.structured_output.utils": "mini_vllm.structured_output.utils",
}

# Upstream's test modules whose imports are not redirected: the KV-connector
# test utilities (connectors are out of scope; tests/v1/core/utils.py imports them).
NOT_REDIRECTED = ("tests.v1.kv_connector",)

# The models the chosen tests name, with the config.json fields vllm reads.
MODEL_CONFIGS = {
    "facebook/opt-125m": {
        "architectures": ["OPTForCausalLM"],
        "model_type": "opt",
        "hidden_size": 768,
        "ffn_dim": 3072,
        "num_attention_heads": 12,
        "num_hidden_layers": 12,
        "max_position_embeddings": 2048,
        "vocab_size": 50272,
        "word_embed_proj_dim": 768,
        "do_layer_norm_before": True,
        "torch_dtype": "float16",
        "bos_token_id": 2,
        "eos_token_id": 2,
        "pad_token_id": 1,
    },
    "Qwen/Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "num_hidden_layers": 28,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "Qwen/Qwen1.5-7B": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "num_hidden_layers": 32,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "vocab_size": 151936,
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151643,
    },
}


class MissingInMiniVllm(Exception):
    """Raised when a test uses an upstream name mini_vllm does not have."""


class Missing:
    """Stands in for ``vllm.X.name`` when mini_vllm's module lacks ``name``."""

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def _fail(self, *args, **kwargs):
        raise MissingInMiniVllm(f"mini_vllm has no {self._qualname}")

    __call__ = __getattr__ = __getitem__ = __iter__ = __bool__ = _fail

    def __repr__(self) -> str:
        return f"<missing in mini_vllm: {self._qualname}>"


# upstream module -> the student's module, with --upstream-labs PHASE.
LAB_MODULES: dict[str, object] = {}
# The student's modules when they hold KV-cache groups' labs (Phase 07): the
# managers, the coordinator and the prefix cache's keys are wired in as
# Phase 07's graders wire them (mini_vllm/grading/hybrid_checks.py).
HYBRID_LABS = None


def module_for(upstream_name: str):
    """mini_vllm's module standing for ``upstream_name`` (the student's, if graded)."""
    if upstream_name in LAB_MODULES:
        return LAB_MODULES[upstream_name]
    return importlib.import_module(MODULE_MAP[upstream_name])


def _load_labs(phase: str) -> None:
    """Point ``LAB_MODULES`` at the student's starters of ``phase`` (as the graders load them)."""
    from mini_vllm.grading import impl, regions

    upstream_of = {mini: upstream for upstream, mini in MODULE_MAP.items()}
    student = impl.load(phase, "labs")
    for path in regions.reference_modules(phase):
        upstream = upstream_of.get(regions.module_name(path))
        if upstream is not None:
            LAB_MODULES[upstream] = getattr(student, path.stem)
    starter = LAB_MODULES.get("vllm.v1.core.kv_cache_utils")
    if starter is not None and "NONE_HASH" in vars(starter):
        # The starter imported NONE_HASH by value: re-seeding must reach its copy.
        reference = importlib.import_module("mini_vllm.core.kv_cache_utils")

        def init_none_hash(hash_fn):
            reference.init_none_hash(hash_fn)
            starter.NONE_HASH = reference.NONE_HASH

        starter.init_none_hash = init_none_hash
    if hasattr(student, "single_type_kv_cache_manager"):
        from mini_vllm.core import block_pool

        global HYBRID_LABS
        HYBRID_LABS = student
        # The reference BlockPool keys its prefix cache with the student's keys.
        block_pool.make_block_hash_with_group_id = (
            student.kv_cache_utils.make_block_hash_with_group_id
        )


class _FromImport:
    """What ``from vllm.X import a, b`` sees: mini_vllm's module, with stand-ins."""

    def __init__(self, upstream_name: str, module) -> None:
        self._upstream_name = upstream_name
        self._module = module

    def __getattr__(self, name: str):
        value = adapter(self._upstream_name, name)
        if value is not None:
            return value
        if hasattr(self._module, name):
            return getattr(self._module, name)
        return Missing(f"{self._upstream_name}.{name}")


class _Namespace:
    """What ``import vllm.a.b`` binds to ``vllm``: attribute paths resolve to
    mini_vllm's (reference) module where ``MODULE_MAP`` has one, else to upstream's."""

    def __init__(self, path: str) -> None:
        self._path = path

    def __getattr__(self, name: str):
        path = f"{self._path}.{name}"
        if path in MODULE_MAP:
            # The reference module even when grading labs: tests reload it and
            # read its module state (NONE_HASH), which a starter only re-exports.
            return importlib.import_module(MODULE_MAP[path])
        if any(key.startswith(path + ".") for key in MODULE_MAP):
            return _Namespace(path)
        return getattr(importlib.import_module(self._path), name)


def _caller_name(module_globals: dict) -> str:
    """The importing module's dotted name under upstream's ``tests`` package. A
    test file in a folder without ``__init__.py`` (tests/v1/metrics/) is
    imported by its bare name (``test_stats``): its file says where it lives."""
    name = module_globals.get("__name__", "")
    file = module_globals.get("__file__")
    if name.startswith("tests.") or not file:
        return name
    try:
        relative = Path(file).resolve().relative_to(CACHE.resolve())
    except ValueError:
        return name
    return ".".join(relative.with_suffix("").parts)


def _redirecting_import(original):
    def __import__(name, globals=None, locals=None, fromlist=(), level=0):
        caller = _caller_name(globals or {})
        if (
            level == 0
            and caller.startswith("tests.")
            and not caller.startswith(NOT_REDIRECTED)
            and (name == "vllm" or name.startswith("vllm."))
        ):
            if fromlist:
                if name in MODULE_MAP:
                    return _FromImport(name, module_for(name))
            elif any(key == name or key.startswith(name + ".") for key in MODULE_MAP) or any(
                name.startswith(key + ".") or name == key for key in MODULE_MAP
            ):
                return _Namespace("vllm")
        return original(name, globals, locals, fromlist, level)

    return __import__


# ---------------------------------------------------------------- adapters
_UNSUPPORTED_DEFAULTS = {
    "model": "facebook/opt-125m",
    "pipeline_parallel_size": 1,
    "use_ec_connector": False,
    "ec_role": None,
}


def mini_vllm_create_scheduler(
    *,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 8192,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = False,
    long_prefill_token_threshold: int = 0,
    num_blocks: int = 10000,
    block_size: int = 16,
    max_model_len: int | None = None,
    policy: str = "fcfs",
    skip_tokenizer_init: bool = False,
    async_scheduling: bool = False,
    num_speculative_tokens: int | None = None,
    use_kv_connector=None,
    disable_chunked_mm_input: bool = False,
    **unsupported,
):
    """Upstream's ``create_scheduler`` keywords, building mini_vllm's Scheduler
    (which never holds a tokenizer, so ``skip_tokenizer_init`` changes nothing),
    its ``AsyncScheduler`` with ``async_scheduling`` and an n-gram speculative
    config with ``num_speculative_tokens``, as upstream's helper builds them;
    ``use_kv_connector`` gives it a KV connector as upstream's helper does
    (tests/v1/core/utils.py:100-120): a ``MockKVConfig`` runs upstream's own
    test connector (its scheduler-side methods use only what mini_vllm's
    scheduler passes), True mini_vllm's ExampleConnector, a name that
    registered connector."""
    for key, value in unsupported.items():
        if key not in _UNSUPPORTED_DEFAULTS:
            raise TypeError(f"create_scheduler() got an unexpected keyword argument {key!r}")
        if value not in (_UNSUPPORTED_DEFAULTS[key], False, None):
            raise MissingInMiniVllm(f"mini_vllm's scheduler has no {key}={value!r}")
    from mini_vllm.testing import create_scheduler

    if async_scheduling:
        scheduler_cls = module_for("vllm.v1.core.sched.async_scheduler").AsyncScheduler
    else:
        scheduler_cls = module_for("vllm.v1.core.sched.scheduler").Scheduler
    return create_scheduler(
        scheduler_cls=scheduler_cls,
        async_scheduling=async_scheduling,
        num_speculative_tokens=num_speculative_tokens,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=enable_chunked_prefill,
        enable_prefix_caching=enable_prefix_caching,
        long_prefill_token_threshold=long_prefill_token_threshold,
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        policy=policy,
        kv_transfer_config=_kv_transfer_config(use_kv_connector),
        disable_chunked_mm_input=disable_chunked_mm_input,
    )


def _kv_transfer_config(use_kv_connector) -> dict | None:
    if use_kv_connector is None or use_kv_connector is False:
        return None
    config = {"kv_role": "kv_both"}
    if type(use_kv_connector).__name__ == "MockKVConfig":
        config["kv_connector"] = "MockKVConnector"
        config["kv_connector_module_path"] = "tests.v1.kv_connector.unit.utils"
        config["kv_connector_extra_config"] = {
            "matched_tokens": use_kv_connector.matched_tokens,
            "is_async": use_kv_connector.is_async,
        }
    elif isinstance(use_kv_connector, str):
        config["kv_connector"] = use_kv_connector
    else:
        config["kv_connector"] = "ExampleConnector"
        config["kv_connector_extra_config"] = {"shared_storage_path": "local_storage"}
    return config


def mini_vllm_create_scheduler_with_priority(**kwargs):
    return mini_vllm_create_scheduler(policy="priority", **kwargs)


def mini_vllm_create_requests(
    num_requests: int,
    num_tokens: int = 10,
    ignore_eos: bool = False,
    max_tokens: int = 16,
    stop_token_ids: list[int] | None = None,
    same_prompt: bool = False,
    block_size: int = 16,
    req_ids: list[str] | None = None,
    mm_hashes_list: list[list[str]] | None = None,
    mm_positions: list | None = None,
    **unsupported,
):
    """Upstream's ``create_requests`` (tests/v1/core/utils.py), building mini_vllm's
    requests the same way: one shared SamplingParams, prompts ``[i] * num_tokens``,
    arrival time now, ids ``"0"``, ``"1"``...; with ``mm_positions``, one image
    feature (no data) per placeholder range, identified by ``mm_hashes_list``
    or ``"hash{i}_{j}"`` (Phase 13)."""
    for key, value in unsupported.items():
        if key != "prompt_logprobs":
            raise TypeError(f"create_requests() got an unexpected keyword argument {key!r}")
        if value is not None:
            raise MissingInMiniVllm(f"mini_vllm's requests have no {key}")
    from mini_vllm.core.kv_cache_utils import get_request_block_hasher
    from mini_vllm.multimodal.inputs import MultiModalFeatureSpec
    from mini_vllm.request import Request
    from mini_vllm.sampling_params import SamplingParams
    from mini_vllm.utils.hashing import sha256

    block_hasher = get_request_block_hasher(block_size, sha256)
    params = SamplingParams(
        ignore_eos=ignore_eos, max_tokens=max_tokens, stop_token_ids=stop_token_ids
    )
    params.update_from_generation_config({}, 50256)
    req_ids = req_ids or [f"{i}" for i in range(num_requests)]
    requests = []
    for i in range(num_requests):
        features = [
            MultiModalFeatureSpec(
                data=None,
                modality="image",
                identifier=f"hash{i}_{j}" if mm_hashes_list is None else mm_hashes_list[i][j],
                mm_position=position,
            )
            for j, position in enumerate(mm_positions[i] if mm_positions else [])
        ]
        request = Request(
            request_id=req_ids[i],
            prompt_token_ids=[0] * num_tokens if same_prompt else [i] * num_tokens,
            sampling_params=params,
            block_hasher=block_hasher,
            mm_features=features or None,
        )
        requests.append(request)
    return requests


class _AdapterMeta(type):
    """An adapter class is its mini_vllm class for ``isinstance``: objects
    mini_vllm builds itself are instances of what the test imported."""

    def __instancecheck__(cls, obj):
        return isinstance(obj, cls.__mro__[1])


def _accepting_absent_features(cls, names: tuple[str, ...]):
    """``cls`` taking upstream's extra keywords ``names`` too, as long as each is
    absent (None, empty or False): they belong to features mini_vllm leaves out."""

    def __init__(self, *args, **kwargs):
        for name in names:
            if kwargs.pop(name, None):
                raise MissingInMiniVllm(f"mini_vllm's {cls.__name__} has no {name}")
        cls.__init__(self, *args, **kwargs)

    namespace = {"__init__": __init__, "__module__": cls.__module__}
    return _AdapterMeta(cls.__name__, (cls,), namespace)


def _spec(name: str):
    """A KV-cache spec built with upstream's extra fields while they are
    absent (``page_size_padded``, ``attention_chunk_size``...): construction
    hands back mini_vllm's own spec, so ``type(spec)`` stays mini's class."""
    spec_cls = getattr(module_for("vllm.v1.kv_cache_interface"), name)

    class SpecMeta(_AdapterMeta):
        def __call__(cls, *args, **kwargs):
            for key in list(kwargs):
                if key not in spec_cls.__dataclass_fields__ and kwargs.pop(key) is not None:
                    raise MissingInMiniVllm(f"mini_vllm's {name} has no {key}")
            return spec_cls(*args, **kwargs)

    return SpecMeta(name, (spec_cls,), {"__module__": spec_cls.__module__})


def _request():
    from mini_vllm.request import Request

    request_cls = _accepting_absent_features(Request, ("pooling_params", "cache_salt"))
    accepting_init = request_cls.__init__

    def __init__(self, *args, **kwargs):
        """A prompt given as embeddings only (``prompt_token_ids=None``) gets
        mini's placeholder ids, zeros, one a row: upstream's Request makes the
        same zeros itself (vllm/v1/request.py:134-138)."""
        embeds = kwargs.get("prompt_embeds")
        if kwargs.get("prompt_token_ids", 0) is None and embeds is not None:
            kwargs["prompt_token_ids"] = [0] * len(embeds)
        accepting_init(self, *args, **kwargs)

    request_cls.__init__ = __init__
    return request_cls


def _sampling_params():
    from mini_vllm.sampling_params import SamplingParams

    params_cls = _accepting_absent_features(
        SamplingParams, ("prompt_logprobs", "thinking_token_budget")
    )
    # Upstream's thinking-budget holder, which the logits-processor tests
    # build, reads this field of every added request: mini's requests have none.
    params_cls.thinking_token_budget = None
    return params_cls


def _kv_cache_manager():
    KVCacheManager = module_for("vllm.v1.core.kv_cache_manager").KVCacheManager

    class UpstreamSignatureKVCacheManager(KVCacheManager):
        """mini_vllm's KVCacheManager built from upstream's arguments: the
        ``KVCacheConfig`` (any groups of one block size), and the block count
        and block size mini's constructor also takes, read from it."""

        def __init__(
            self,
            kv_cache_config,
            max_model_len,
            hash_block_size=None,
            max_num_batched_tokens=None,
            enable_caching=True,
            **kwargs,
        ):
            groups = kv_cache_config.kv_cache_groups
            block_sizes = {group.kv_cache_spec.block_size for group in groups}
            if len(block_sizes) != 1:
                raise MissingInMiniVllm("mini_vllm's KV-cache groups share one block size")
            block_size = block_sizes.pop()
            if hash_block_size not in (None, block_size):
                raise MissingInMiniVllm("mini_vllm hashes blocks of the cache's block size")
            for key, value in kwargs.items():
                if value:
                    raise MissingInMiniVllm(f"mini_vllm's KVCacheManager has no {key}")
            super().__init__(
                kv_cache_config.num_blocks,
                block_size,
                max_model_len,
                enable_caching,
                kv_cache_config=kv_cache_config,
                max_num_batched_tokens=max_num_batched_tokens,
            )
            if HYBRID_LABS is not None and self.coordinator is not None:
                from mini_vllm.grading.hybrid_checks import your_coordinator

                self.coordinator = your_coordinator(
                    HYBRID_LABS,
                    kv_cache_config,
                    max_model_len,
                    max_num_batched_tokens or max_model_len,
                    enable_caching,
                )
                self.block_pool = self.coordinator.block_pool
            lookup = self.block_pool.cached_block_hash_to_block
            self.block_pool.cached_block_hash_to_block = _BlockLookupView(lookup)

        def new_step_starts(self) -> None:
            """Upstream's per-step hook: only its Mamba manager acts on it
            (vllm/v1/core/single_type_kv_cache_manager.py:476, :1118)."""

    return UpstreamSignatureKVCacheManager


def _model_runner_output():
    from mini_vllm.outputs import ModelRunnerOutput

    return _accepting_absent_features(
        ModelRunnerOutput,
        ("prompt_logprobs_dict", "pooler_output", "num_nans_in_logits"),
    )


class _BlockLookupView(dict):
    """mini_vllm's prefix cache (key -> {block id: block}) answering the two
    calls of upstream's ``BlockHashToBlockMap`` that tests use to plant
    cached blocks: ``insert(key, block)`` and ``_cache.clear()``."""

    @property
    def _cache(self):
        return self

    def insert(self, key, block) -> None:
        self.setdefault(key, {})[block.block_id] = block


def _block_pool():
    BlockPool = module_for("vllm.v1.core.block_pool").BlockPool

    class UpstreamSignatureBlockPool(BlockPool, metaclass=_AdapterMeta):
        """mini_vllm's BlockPool given upstream's keywords. ``hash_block_size`` is
        dropped: mini_vllm always hashes blocks of the cache's own block size."""

        def __init__(self, num_gpu_blocks, enable_caching, hash_block_size=None, **kwargs):
            for key, value in kwargs.items():
                if value:
                    raise MissingInMiniVllm(f"mini_vllm's BlockPool has no {key}")
            super().__init__(num_gpu_blocks, enable_caching)
            self.cached_block_hash_to_block = _BlockLookupView()
            self.hash_block_size = hash_block_size

        def cache_full_blocks(
            self,
            request,
            blocks,
            num_cached_blocks,
            num_full_blocks,
            block_size=None,
            kv_cache_group_id=0,
            block_mask=None,
        ):
            """Upstream passes the group's block size, which mini's pool
            (one block size) does not need; a mask is a feature it leaves out."""
            _absent("block_size", block_size, self.hash_block_size)
            _absent("block_mask", block_mask, None)
            super().cache_full_blocks(
                request, blocks, num_cached_blocks, num_full_blocks, kv_cache_group_id
            )

    UpstreamSignatureBlockPool.__name__ = "BlockPool"
    return UpstreamSignatureBlockPool


def _absent(name: str, value, absent_value) -> None:
    """Refuse an upstream argument that asks for something mini_vllm leaves out."""
    if value is not None and value != absent_value:
        raise MissingInMiniVllm(f"mini_vllm's KV-cache managers have no {name}={value!r}")


def _single_type_manager(name: str):
    manager_cls = getattr(module_for("vllm.v1.core.single_type_kv_cache_manager"), name)
    if HYBRID_LABS is not None:
        # The student's class with the methods the starter re-opens on the base.
        from mini_vllm.grading.hybrid_checks import manager_classes

        (manager_cls,) = [c for c in manager_classes(HYBRID_LABS).values() if c.__name__ == name]

    class UpstreamSignatureManager(manager_cls, metaclass=_AdapterMeta):
        """mini_vllm's per-group manager called with upstream's extra arguments,
        accepted while they ask for nothing mini leaves out: no spec-decode
        lookahead (``num_tokens_main_model`` equals ``num_tokens``), no KV
        connector (``num_external_computed_tokens`` 0), no EAGLE, no context
        parallelism, and an ``alignment_tokens`` of one block (every group
        has one block size)."""

        def get_num_blocks_to_allocate(
            self,
            request_id,
            num_tokens,
            new_computed_blocks,
            total_computed_tokens,
            num_tokens_main_model=None,
            apply_admission_cap=False,
        ):
            _absent("num_tokens_main_model", num_tokens_main_model, num_tokens)
            return super().get_num_blocks_to_allocate(
                request_id,
                num_tokens,
                new_computed_blocks,
                total_computed_tokens,
                apply_admission_cap=apply_admission_cap,
            )

        def allocate_new_computed_blocks(
            self,
            request_id,
            new_computed_blocks,
            num_local_computed_tokens,
            num_external_computed_tokens=0,
        ):
            _absent("num_external_computed_tokens", num_external_computed_tokens, 0)
            super().allocate_new_computed_blocks(
                request_id, new_computed_blocks, num_local_computed_tokens
            )

        def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model=None):
            _absent("num_tokens_main_model", num_tokens_main_model, num_tokens)
            return super().allocate_new_blocks(request_id, num_tokens)

        @classmethod
        def find_longest_cache_hit(
            cls,
            block_hashes,
            max_length,
            kv_cache_group_ids,
            block_pool,
            kv_cache_spec,
            use_eagle=False,
            alignment_tokens=None,
            dcp_world_size=1,
            pcp_world_size=1,
        ):
            _absent("use_eagle", use_eagle, False)
            _absent("alignment_tokens", alignment_tokens, kv_cache_spec.block_size)
            _absent("dcp_world_size", dcp_world_size, 1)
            _absent("pcp_world_size", pcp_world_size, 1)
            return manager_cls.find_longest_cache_hit(
                block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec
            )

    UpstreamSignatureManager.__name__ = name
    return UpstreamSignatureManager


def _scheduler_output():
    from mini_vllm.core.sched.output import SchedulerOutput

    return _accepting_absent_features(SchedulerOutput, ())


def _sampling_metadata():
    SamplingMetadata = module_for("vllm.v1.sample.metadata").SamplingMetadata

    class UpstreamSignatureSamplingMetadata(SamplingMetadata, metaclass=_AdapterMeta):
        """mini_vllm's SamplingMetadata given upstream's fields. Upstream blocks
        min_tokens in a logits processor, mini in ``min_tokens_blocked``: a
        test that builds no such processor gets no blocked rows. Upstream's
        thinking-budget holder is kept for the test's helpers while it tracks
        no request (mini's requests cannot ask for a budget); mini's sampler
        never reads it."""

        def __init__(self, *args, spec_token_ids=None, thinking_budget_state_holder=None, **kwargs):
            if any(spec_token_ids or ()):
                raise MissingInMiniVllm("mini_vllm's SamplingMetadata has no spec_token_ids")
            if kwargs.pop("logprob_token_ids", None) is not None:
                raise MissingInMiniVllm("mini_vllm's SamplingMetadata has no logprob_token_ids")
            holder = thinking_budget_state_holder
            if holder is not None and holder.has_tracked_requests():
                raise MissingInMiniVllm("mini_vllm has no thinking budget")
            kwargs.setdefault("min_tokens_blocked", {})
            super().__init__(*args, **kwargs)
            self.thinking_budget_state_holder = holder

    UpstreamSignatureSamplingMetadata.__name__ = "SamplingMetadata"
    return UpstreamSignatureSamplingMetadata


def _input_batch():
    InputBatch = module_for("vllm.v1.worker.gpu_input_batch").InputBatch

    class UpstreamSignatureInputBatch(InputBatch, metaclass=_AdapterMeta):
        """mini_vllm's InputBatch given upstream's keywords. mini's kernels use
        the KV cache's own block size, so ``kernel_block_sizes`` must equal it."""

        def __init__(self, *args, kernel_block_sizes=None, **kwargs):
            block_sizes = kwargs.get("block_sizes", args[6] if len(args) > 6 else None)
            if kernel_block_sizes not in (None, block_sizes):
                raise MissingInMiniVllm("mini_vllm's kernels use the KV cache's block size")
            for key in list(kwargs):
                if key not in inspect.signature(InputBatch.__init__).parameters:
                    if kwargs.pop(key):
                        raise MissingInMiniVllm(f"mini_vllm's InputBatch has no {key}")
            super().__init__(*args, **kwargs)

    UpstreamSignatureInputBatch.__name__ = "InputBatch"
    return UpstreamSignatureInputBatch


def _cached_request_state():
    state = module_for("vllm.v1.worker.gpu_input_batch").CachedRequestState
    return _accepting_absent_features(state, ("pooling_params",))


def _as_if_defined_in(func, module):
    """``func`` run with ``module``'s globals. A starter re-exports reference
    functions that sit outside its labs; re-homed, they call the student's
    code (the starter's ``apply_penalties``), not the reference's."""
    if func.__module__ == module.__name__:
        return func
    return types.FunctionType(
        func.__code__, vars(module), func.__name__, func.__defaults__, func.__closure__
    )


def _sampler():
    Sampler = module_for("vllm.v1.sample.sampler").Sampler
    penalties = module_for("vllm.v1.sample.ops.penalties")
    apply_all_penalties = _as_if_defined_in(penalties.apply_all_penalties, penalties)

    class UpstreamSignatureSampler(Sampler, metaclass=_AdapterMeta):
        """mini_vllm's Sampler with upstream's two entry points the tests call.
        mini applies the penalties last inside ``apply_logits_processors`` (Lab
        06.4) and has no drafts there, so ``predict_bonus_token`` must be False."""

        def apply_logits_processors(self, logits, metadata, predict_bonus_token=False):
            if predict_bonus_token:
                raise MissingInMiniVllm("mini_vllm's sampler has no predict_bonus_token")
            return super().apply_logits_processors(logits, metadata)

        @staticmethod
        def apply_penalties(logits, metadata, output_token_ids):
            if metadata.no_penalties:
                return logits
            return apply_all_penalties(
                logits,
                metadata.prompt_token_ids,
                metadata.presence_penalties,
                metadata.frequency_penalties,
                metadata.repetition_penalties,
                output_token_ids,
            )

    UpstreamSignatureSampler.__name__ = "Sampler"
    return UpstreamSignatureSampler


def _build_logitsprocs():
    lp = module_for("vllm.v1.sample.logits_processor")

    def build_logitsprocs(
        vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs=()
    ):
        """Upstream's builder for a generating model without drafts: mini's
        built-ins in upstream's order (mini's runner leaves min_tokens to its
        batch, so it builds them itself), then custom classes."""
        if is_pooling_model:
            raise MissingInMiniVllm("mini_vllm has no pooling models")
        if vllm_config.speculative_config is not None:
            raise MissingInMiniVllm("mini_vllm builds no logits processors for drafts")
        if any(isinstance(custom, str) for custom in custom_logitsprocs):
            raise MissingInMiniVllm("mini_vllm loads logits processors by class only")
        classes = [*lp.BUILTIN_LOGITS_PROCESSORS, *custom_logitsprocs]
        return lp.LogitsProcessors(cls(vllm_config, device, is_pin_memory) for cls in classes)

    return build_logitsprocs


def _rejection_sampler():
    module = module_for("vllm.v1.sample.rejection_sampler")
    reference = importlib.import_module(MODULE_MAP["vllm.v1.sample.rejection_sampler"])
    # The starter's names over the reference's (the starter imports only what its labs use).
    scope = types.ModuleType(module.__name__)
    vars(scope).update({**vars(reference), **vars(module)})
    forward = _as_if_defined_in(module.RejectionSampler.forward, scope)

    class RejectionSampler(module.RejectionSampler, metaclass=_AdapterMeta):
        """mini_vllm's RejectionSampler verifying with the ``rejection_sample``
        of the module the test imports: a starter re-exports the reference
        class, whose ``forward`` would call the reference's."""

        __call__ = forward

    RejectionSampler.forward = forward
    return RejectionSampler


def _sample_recovered_tokens():
    rejection_sampler = module_for("vllm.v1.sample.rejection_sampler")

    def sample_recovered_tokens(
        max_spec_len,
        num_draft_tokens,
        cu_num_draft_tokens,
        draft_token_ids,
        draft_probs,
        target_probs,
        sampling_metadata,
        device,
    ):
        """Upstream's signature; mini reads the lengths and the device from the
        other arguments. Upstream's kernel reads the draft ids by position
        whatever their shape (the test's are ``[num_tokens, 1]``) and answers
        in that shape; mini takes them flat."""
        recovered = rejection_sampler.sample_recovered_tokens(
            num_draft_tokens,
            draft_token_ids.reshape(-1),
            draft_probs,
            target_probs,
            sampling_metadata,
        )
        return recovered.view_as(draft_token_ids)

    return sample_recovered_tokens


def _generate_block_hash_extra_keys():
    kv_cache_utils = module_for("vllm.v1.core.kv_cache_utils")
    generate = kv_cache_utils.generate_block_hash_extra_keys
    if len(inspect.signature(generate).parameters) > 1:
        return generate  # upstream's signature already

    def generate_block_hash_extra_keys(request, start_token_idx, end_token_idx, start_mm_idx):
        """Upstream's signature: a block range and the first multimodal input
        to look at, and the next one back. mini's keys (the LoRA name only)
        are the same for every block of a request, so it takes the request."""
        return generate(request), start_mm_idx

    return generate_block_hash_extra_keys


def _find_longest_matched_ngram():
    NgramProposer = module_for("vllm.v1.spec_decode.ngram_proposer").NgramProposer

    def _find_longest_matched_ngram_and_propose_tokens(
        origin_tokens, min_ngram, max_ngram, max_model_len, k
    ):
        """Upstream's module function; mini_vllm has it as ``propose_one``."""
        proposer = NgramProposer(min_ngram, max_ngram, k, max_model_len)
        return proposer.propose_one(origin_tokens)

    return _find_longest_matched_ngram_and_propose_tokens


# (upstream module, name) -> a function building what a test gets for that name.
ADAPTER_FACTORIES = {
    ("vllm.v1.request", "Request"): _request,
    ("vllm.v1.core.kv_cache_manager", "Request"): _request,
    ("vllm.sampling_params", "SamplingParams"): _sampling_params,
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager"): _kv_cache_manager,
    ("vllm.v1.core.block_pool", "BlockPool"): _block_pool,
    ("vllm.v1.outputs", "ModelRunnerOutput"): _model_runner_output,
    ("vllm.v1.core.sched.output", "SchedulerOutput"): _scheduler_output,
    ("vllm.v1.sample.metadata", "SamplingMetadata"): _sampling_metadata,
    ("vllm.v1.sample.sampler", "Sampler"): _sampler,
    ("vllm.v1.sample.logits_processor", "build_logitsprocs"): _build_logitsprocs,
    ("vllm.v1.sample.sampler", "SamplerOutput"): lambda: _accepting_absent_features(
        module_for("vllm.v1.sample.sampler").SamplerOutput, ("logprobs_tensors",)
    ),
    ("vllm.v1.sample.rejection_sampler", "sample_recovered_tokens"): _sample_recovered_tokens,
    ("vllm.v1.sample.rejection_sampler", "RejectionSampler"): _rejection_sampler,
    ("vllm.v1.worker.gpu_input_batch", "InputBatch"): _input_batch,
    ("vllm.v1.worker.gpu_input_batch", "CachedRequestState"): _cached_request_state,
    ("vllm.v1.core.kv_cache_utils", "generate_block_hash_extra_keys"): (
        _generate_block_hash_extra_keys
    ),
    ("vllm.v1.spec_decode.ngram_proposer", "_find_longest_matched_ngram_and_propose_tokens"): (
        _find_longest_matched_ngram
    ),
    # mini's name for upstream's torch implementation (upstream's apply_top_k_top_p
    # dispatches to it or to FlashInfer; mini has the torch one only).
    ("vllm.v1.sample.ops.topk_topp_sampler", "apply_top_k_top_p_pytorch"): lambda: (
        module_for("vllm.v1.sample.ops.topk_topp_sampler").apply_top_k_top_p
    ),
    # The processed tensors of one item, which mini's features hold as a plain
    # dict (or None); tests only hand a dummy one to scheduler-side features.
    ("vllm.multimodal.inputs", "MultiModalKwargsItem"): lambda: (
        importlib.import_module("vllm.multimodal.inputs").MultiModalKwargsItem
    ),
    # A read-only list view mini does not have; tests only wrap lists in it.
    ("vllm.v1.utils", "ConstantList"): lambda: (
        importlib.import_module("vllm.v1.utils").ConstantList
    ),
    ("vllm.v1.kv_cache_interface", "FullAttentionSpec"): lambda: _spec("FullAttentionSpec"),
    ("vllm.v1.kv_cache_interface", "SlidingWindowSpec"): lambda: _spec("SlidingWindowSpec"),
    ("vllm.v1.core.single_type_kv_cache_manager", "SlidingWindowManager"): lambda: (
        _single_type_manager("SlidingWindowManager")
    ),
    ("vllm.v1.core.single_type_kv_cache_manager", "FullAttentionManager"): lambda: (
        _single_type_manager("FullAttentionManager")
    ),
}


@functools.cache
def adapter(upstream_name: str, name: str):
    factory = ADAPTER_FACTORIES.get((upstream_name, name))
    return factory() if factory is not None else None


HELPER_ADAPTERS = {
    "create_requests": mini_vllm_create_requests,
    "create_scheduler": mini_vllm_create_scheduler,
    "create_scheduler_with_priority": mini_vllm_create_scheduler_with_priority,
}


# ---------------------------------------------------------------- pytest hooks
def pytest_addoption(parser):
    parser.addoption("--upstream-target", choices=["vllm", "mini_vllm"], default="vllm")
    parser.addoption("--upstream-report", default=None, help="write {nodeid: outcome} here")
    parser.addoption(
        "--upstream-labs",
        default=None,
        metavar="PHASE",
        help="with --upstream-target=mini_vllm: the student's starters of PHASE stand in "
        "for mini_vllm's modules",
    )


def _write_model_configs() -> Path:
    hub = CACHE / "hf-hub"
    for model_id, config in MODEL_CONFIGS.items():
        repo = hub / f"models--{model_id.replace('/', '--')}"
        snapshot = repo / "snapshots" / ("0" * 40)
        snapshot.mkdir(parents=True, exist_ok=True)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text("0" * 40)
        (snapshot / "config.json").write_text(json.dumps(config, indent=1))
    return hub


def pytest_configure(config):
    os.environ["HF_HUB_CACHE"] = str(_write_model_configs())
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    for mark in ("cpu_test", "core_model", "slow_test"):
        config.addinivalue_line("markers", f"{mark}: upstream's mark")
    config.upstream_outcomes = {}

    from vllm.config import device

    original_post_init = device.DeviceConfig.__post_init__

    def cpu_post_init(self):
        if self.device == "auto":
            self.device = "cpu"
        original_post_init(self)

    device.DeviceConfig.__post_init__ = cpu_post_init

    # Tests that build tensors on "the platform's device" (the sampler's, the
    # input batch's) read current_platform.device_type and device_count(); the
    # platform found on a machine without a GPU has neither. It answers "cpu"
    # (device_count then comes from torch.cpu) and, like vLLM's CPU platform
    # on this machine, reports no pinned memory (pinning needs a CUDA driver).
    from vllm.platforms import current_platform

    current_platform.device_type = "cpu"
    type(current_platform).is_pin_memory_available = classmethod(lambda cls: False)

    if os.environ.get("TRITON_INTERPRET") == "1":
        # Without a GPU driver vLLM put placeholders in vllm.triton_utils; with
        # the real Triton back, upstream's kernels run under its interpreter.
        import triton
        import triton.language as tl
        import vllm.triton_utils as triton_utils

        triton_utils.triton, triton_utils.tl = triton, tl

    if config.getoption("--upstream-target") == "mini_vllm":
        if config.getoption("--upstream-labs"):
            _load_labs(config.getoption("--upstream-labs"))
        builtins.__import__ = _redirecting_import(builtins.__import__)


def pytest_collection_modifyitems(config, items):
    if config.getoption("--upstream-target") != "mini_vllm":
        return
    import sys

    for module in [m for name, m in sys.modules.items() if name.startswith("tests.")]:
        for name, replacement in HELPER_ADAPTERS.items():
            if inspect.isfunction(module.__dict__.get(name)):
                setattr(module, name, replacement)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    outcomes = item.config.upstream_outcomes
    if report.when == "call" or report.outcome != "passed":
        if outcomes.get(item.nodeid) in (None, "passed"):
            outcomes[item.nodeid] = report.outcome


def pytest_sessionfinish(session):
    path = session.config.getoption("--upstream-report")
    if path:
        Path(path).write_text(json.dumps(session.config.upstream_outcomes, indent=0))
