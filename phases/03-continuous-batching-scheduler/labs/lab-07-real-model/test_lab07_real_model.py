"""Phase 03, whole phase: your scheduler drives a real model.

SmolLM2-135M generates through mini_vllm's engine twice, once with the
reference Scheduler and once with yours (every lab region is your code),
plugged in through ``scheduler_cls`` as upstream's SchedulerConfig allows.
A tiny token budget forces chunked prefill and a tiny KV cache forces
preemptions. Greedy decoding is deterministic, so every request's tokens,
and the number of steps and preemptions, must be the reference's. On CUDA
the runs use the GPU; without it, the CPU.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from mini_vllm.core.sched.scheduler import Scheduler as ReferenceScheduler
from mini_vllm.engine.llm_engine import LLMEngine
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.model_executor.model_loader import smollm2_gguf_path
from mini_vllm.oracle.workload import Progress
from mini_vllm.sampling_params import SamplingParams

pytestmark = [pytest.mark.phase, pytest.mark.timeout(900)]

SHARED = "The quick brown fox jumps over the lazy dog. " * 3
PROMPTS = [
    "The capital of France is",
    "Continuous batching lets an inference server",
    "Write a haiku about the sea:",
    "In 1969, the first humans to walk on the Moon were",
    "A list of three prime numbers: 2, 3,",
    # These two share their first block of 16 tokens: the second can start
    # from the first's cached KV (prefix caching) if it is still cached.
    SHARED + "Once more, slowly: the quick brown fox",
    SHARED + "Now count the words in that sentence:",
    "Paged attention stores the KV cache in fixed-size blocks so that",
]


@pytest.fixture(scope="module")
def llm():
    """SmolLM2 with a 16-token step budget (long prompts are chunked) and a
    KV cache of 17 blocks of 16 tokens: room for one max_model_len request,
    not for all eight at once, so requests get preempted. Loaded by the first
    test that calls it, after ``finished_lab``: an unwritten region fails
    before the model loads."""

    @functools.cache
    def load() -> LLM:
        return LLM(
            str(smollm2_gguf_path()),
            max_model_len=256,
            max_num_seqs=8,
            max_num_batched_tokens=16,
            enable_chunked_prefill=True,
            enable_prefix_caching=True,
            block_size=16,
            num_gpu_blocks_override=17,
            device="cuda" if torch.cuda.is_available() else "cpu",
            dtype="float32",
        )

    return load


def generate(llm: LLM, scheduler_cls: type, policy: str = "fcfs", priorities=None):
    """(token ids per prompt, engine stats) with ``scheduler_cls`` scheduling;
    the model weights are shared, the engine and its KV cache are new."""
    base = llm.llm_engine
    config = dataclasses.replace(
        base.vllm_config,
        scheduler_config=dataclasses.replace(
            base.vllm_config.scheduler_config, scheduler_cls=scheduler_cls, policy=policy
        ),
        cache_config=dataclasses.replace(base.vllm_config.cache_config),
    )
    engine = LLMEngine(config, (base.model, base.hf_config, base.tokenizer))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params, priority=priorities[i] if priorities else 0)
    done = {}
    progress = Progress()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        progress.after_step(engine.engine_core.scheduler, engine.engine_core.num_steps)
    return [done[str(i)] for i in range(len(PROMPTS))], engine.get_stats()


def compare(llm, student_cls, **kwargs):
    got, stats = generate(llm, student_cls, **kwargs)  # yours first: fails fast
    expected, ref_stats = generate(llm, ReferenceScheduler, **kwargs)
    assert ref_stats["num_preemptions"] > 0, "the setup must force preemptions"
    tokenizer = llm.get_tokenizer()
    for i, (e, g) in enumerate(zip(expected, got, strict=True)):
        if e != g:
            k = next(
                (j for j, (a, b) in enumerate(zip(e, g, strict=False)) if a != b),
                min(len(e), len(g)),
            )
            pytest.fail(
                f"prompt {i} ({PROMPTS[i][:40]!r}...): output token {k} differs: reference "
                f"{e[k : k + 1]} {tokenizer.decode(e[: k + 1])!r}, yours {g[k : k + 1]} "
                f"{tokenizer.decode(g[: k + 1])!r}. Greedy decoding is deterministic, so your "
                "scheduler fed the model different tokens or positions: run the lab checks "
                "(make check-lab-03.1 ... 03.6) to find the broken rule."
            )
    for key in ("num_steps", "num_preemptions", "num_scheduled_tokens", "prefix_cache_hits"):
        assert stats[key] == ref_stats[key], (
            f"same tokens, but {key} differs: reference {ref_stats[key]}, yours {stats[key]}. "
            "Your scheduler takes different decisions (chunk sizes, victims or prefix hits)."
        )


@pytest.mark.points(10)
def test_smollm2_fcfs_with_chunked_prefill_and_preemption(llm, finished_lab):
    compare(llm(), finished_lab.scheduler.Scheduler)


@pytest.mark.points(5)
def test_smollm2_priority_policy(llm, finished_lab):
    compare(
        llm(),
        finished_lab.scheduler.Scheduler,
        policy="priority",
        priorities=[3, 0, 2, 1, 0, 3, 1, 2, 0],
    )
