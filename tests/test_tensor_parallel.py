"""Phase 17: a model split over worker processes generates what it generates whole.

``LLM(..., tensor_parallel_size=N, distributed_executor_backend="mp")`` runs
the model in N worker processes (``MultiprocExecutor``), each holding its
slice of every weight and its KV heads only. Greedy tokens must equal the
same model's with one process and transformers' on the same weights:

- fast: the tiny seeded Llama (4 query heads, 2 KV heads) with TP=2; each
  rank's KV cache holds one KV head, so a block takes half the bytes and
  the same byte budget holds twice the requests; each step does one
  all-reduce for the embedding and two a layer (after o_proj, after
  down_proj) and one all-gather of the logits. Then one worker is killed:
  the next ``generate`` fails with an error naming the dead rank, and no
  worker process is left;
- deep: SmolLM2-135M (9 query heads, 3 KV heads) with TP=3 under both
  executors ("mp" and "ray"), a worker that hangs (stopped with SIGSTOP):
  the step times out (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS) and every worker
  is stopped; and the tiny Llama on Ray with a killed actor.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
from transformers import AutoModelForCausalLM

from mini_vllm.entrypoints.llm import LLM
from mini_vllm.executor.multiproc_executor import WorkerFailedError
from mini_vllm.kv_cache_interface import get_max_concurrency_for_kv_cache_config
from mini_vllm.model_executor.model_loader.tiny import make_tiny_model
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.testing import hf_greedy

NUM_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
KV_BYTES = 4 * 2**20


def greedy_tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def concurrency(llm: LLM) -> float:
    core = llm.llm_engine.engine_core
    return get_max_concurrency_for_kv_cache_config(
        llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
        core.kv_cache_spec,
        core.num_layers,
        llm.llm_engine.vllm_config.model_config.max_model_len,
    )


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tp"), "llama", seed=0)


def test_tiny_llama_tp2_equals_tp1_and_transformers_and_a_dead_worker_fails(tiny_llama):
    g = torch.Generator().manual_seed(3)
    # 28 tokens span two blocks of 16; the decode reaches a third.
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (28, 5)]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    expected = [hf_greedy(hf, p, NUM_TOKENS) for p in prompts]

    whole = LLM(str(tiny_llama), kv_cache_memory_bytes=KV_BYTES, max_model_len=128)
    split = LLM(
        str(tiny_llama),
        kv_cache_memory_bytes=KV_BYTES,
        max_model_len=128,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
    )
    try:
        assert greedy_tokens(whole, prompts) == expected, "TP=1 differs from transformers"
        assert greedy_tokens(split, prompts) == expected, "TP=2 differs from transformers"

        # Each rank's cache holds its KV heads only: half the bytes a block.
        spec1 = whole.llm_engine.engine_core.kv_cache_spec
        spec2 = split.llm_engine.engine_core.kv_cache_spec
        assert (spec1.num_kv_heads, spec2.num_kv_heads) == (2, 1)
        assert split.llm_engine.engine_core.bytes_per_block * 2 == (
            whole.llm_engine.engine_core.bytes_per_block
        )
        assert concurrency(split) >= 2 * concurrency(whole) - 0.5, (
            "the same KV budget per rank should hold twice the requests with TP=2"
        )

        # One all-reduce for the embedding, then one after o_proj and one after
        # down_proj in each layer; one all-gather of the logits: every step.
        core, hf_config = split.llm_engine.engine_core, split.llm_engine.hf_config
        per_forward = 1 + 2 * hf_config.num_hidden_layers
        for rank, stats in enumerate(core.model_executor.collective_rpc("comm_stats")):
            assert stats["calls"] == {
                "all_reduce": per_forward * core.num_steps,
                "all_gather": core.num_steps,
            }, f"rank {rank}: collectives {stats['calls']} over {core.num_steps} steps"
            assert stats["bytes"]["all_reduce"] == (
                per_forward * core.num_scheduled_tokens * hf_config.hidden_size * 4
            ), f"rank {rank}: all-reduced bytes"

        executor = split.llm_engine.engine_core.model_executor
        procs = list(executor.procs)
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].join(10)
        with pytest.raises(WorkerFailedError, match="worker rank 1 died"):
            greedy_tokens(split, prompts)
        assert not any(p.is_alive() for p in procs), "a worker process was left running"
        with pytest.raises(WorkerFailedError, match="have failed"):
            greedy_tokens(split, prompts)
    finally:
        split.llm_engine.engine_core.shutdown()


def needs_ray(backend: str) -> None:
    if backend == "ray":
        pytest.importorskip("ray", reason="ray is not installed (the project's `ray` extra)")


@pytest.mark.deep
@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_smollm2_tp3_equals_tp1_and_transformers(smollm2_hf, backend):
    needs_ray(backend)
    path, hf = smollm2_hf
    whole = LLM(str(path), kv_cache_memory_bytes=64 * 2**20, max_model_len=256)
    tokenizer = whole.get_tokenizer()
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompts = [tokenizer("The capital of France is")["input_ids"], tokenizer(chat)["input_ids"]]
    expected = [hf_greedy(hf, p, NUM_TOKENS) for p in prompts]
    assert greedy_tokens(whole, prompts) == expected, "TP=1 differs from transformers"
    del whole
    split = LLM(
        str(path),
        kv_cache_memory_bytes=64 * 2**20,
        max_model_len=256,
        tensor_parallel_size=3,
        distributed_executor_backend=backend,
    )
    try:
        assert split.llm_engine.engine_core.kv_cache_spec.num_kv_heads == 1  # 3 KV heads / 3
        assert greedy_tokens(split, prompts) == expected, "TP=3 differs from transformers"
    finally:
        split.llm_engine.engine_core.shutdown()


@pytest.mark.deep
def test_a_hung_worker_times_out_and_every_worker_stops(tiny_llama, monkeypatch):
    split = LLM(str(tiny_llama), kv_cache_memory_bytes=KV_BYTES, tensor_parallel_size=2)
    procs = list(split.llm_engine.engine_core.model_executor.procs)
    try:
        monkeypatch.setenv("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "5")
        os.kill(procs[0].pid, signal.SIGSTOP)
        with pytest.raises(WorkerFailedError, match=r"sent no answer .* within 5 s"):
            greedy_tokens(split, [[5, 6, 7]])
        assert not any(p.is_alive() for p in procs), "a worker process was left running"
    finally:
        split.llm_engine.engine_core.shutdown()


@pytest.mark.deep
def test_ray_tiny_llama_tp2_equals_transformers_and_a_dead_actor_fails(tiny_llama):
    """The Ray executor on a local Ray cluster (started by the executor, as
    ``ray start`` would across hosts): the same tokens, and a killed actor
    ends the engine with the rank named and the cluster stopped."""
    ray = pytest.importorskip("ray", reason="ray is not installed (the project's `ray` extra)")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (28, 5)]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    expected = [hf_greedy(hf, p, NUM_TOKENS) for p in prompts]
    split = LLM(
        str(tiny_llama),
        kv_cache_memory_bytes=KV_BYTES,
        max_model_len=128,
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
    )
    try:
        assert greedy_tokens(split, prompts) == expected, "TP=2 on Ray differs from transformers"
        executor = split.llm_engine.engine_core.model_executor
        os.kill(ray.get(executor.workers[1].get_pid.remote()), signal.SIGKILL)
        with pytest.raises(WorkerFailedError, match="worker rank 1 died"):
            greedy_tokens(split, prompts)
        assert not ray.is_initialized(), "the executor's local Ray cluster was left running"
    finally:
        split.llm_engine.engine_core.shutdown()


def test_a_dead_worker_is_named_when_no_other_rank_notices():
    """A worker killed between calls while its peers sit idle (no collective
    fails on them): its closed pipe fails the executor, naming it, and every
    worker is stopped. Before, collective_rpc read EOF from that pipe,
    skipped it as "its sentinel says so", and the sentinel check skipped it
    too (the pipe was readable), so the call waited forever."""
    from mini_vllm.executor.multiproc_executor import MultiprocExecutor
    from mini_vllm.grading.tp_checks import executor_over_echo_workers, wait_gone

    executor = executor_over_echo_workers(MultiprocExecutor, 2)
    procs = list(executor.procs)
    assert executor.collective_rpc("whoami", timeout=30) == [0, 1]
    os.kill(procs[1].pid, signal.SIGKILL)
    procs[1].join(10)
    with pytest.raises(WorkerFailedError, match="worker rank 1 died"):
        executor.collective_rpc("whoami", timeout=30)
    assert not wait_gone(procs), "a worker process was left running"
