"""Phase 19's two scheduling designs v1 does not use, graded by properties.

``SwapScheduler`` (vLLM v0's preemption by swapping) and
``PrefillFirstScheduler`` (nano-vllm's prefill-or-decode steps) run
generated workloads with a fake model. The driver also keeps a fake KV
cache: every GPU and CPU block holds the token ids written into it, the
step's swap maps are copied before the "forward", and each scheduled
request must find its computed tokens in its block table before its new
ones are written. After every step: no step over the token budget or
max_num_seqs; prefill-first never mixes prefills with decodes. At the end:
every request finished with its max_tokens, every block back in both pools.
Swapping must really swap, and never recompute while the CPU space could
hold the victim. On real weights (a tiny seeded Qwen3; SmolLM2 in the deep
tier) greedy tokens of each variant equal the default scheduler's under
memory pressure.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mini_vllm.testing as mini
from mini_vllm.core.sched.prefill_first_scheduler import PrefillFirstScheduler
from mini_vllm.core.sched.scheduler import Scheduler
from mini_vllm.core.sched.swap_scheduler import SwapScheduler
from mini_vllm.grading.variant_checks import (
    PRESSURE,
    build,
    check_end,
    drive,
    greedy,
    pressure_prompts,
    workloads,
)
from mini_vllm.request import RequestStatus
from mini_vllm.tiers import examples

PROPERTY = settings(
    max_examples=examples(deep=300, fast=40),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@PROPERTY
@given(w=workloads, cpu_extra=st.integers(0, 12))
def test_swap_scheduler_loses_nothing_and_gives_every_block_back(w, cpu_extra):
    sched, requests, arrivals, num_blocks = build(SwapScheduler, w, num_cpu_blocks=cpu_extra)
    result = drive(sched, requests, arrivals)
    check_end(sched, requests, result, num_blocks)
    assert len(sched.free_cpu_block_ids) == cpu_extra, "CPU blocks never came back"
    assert sorted(sched.free_cpu_block_ids) == list(range(cpu_extra))
    assert not sched.swapped and not sched.req_to_cpu_blocks


@PROPERTY
@given(w=workloads)
def test_swap_scheduler_swaps_and_never_recomputes_while_swap_space_is_free(w):
    # CPU space for the whole GPU pool: every victim fits.
    sched, requests, arrivals, num_blocks = build(SwapScheduler, w, num_cpu_blocks=64)
    result = drive(sched, requests, arrivals)
    check_end(sched, requests, result, num_blocks)
    preemptions = sum(r.num_preemptions for r in requests)
    assert sched.num_recompute_preemptions == 0, "recomputed while the swap space was free"
    assert sched.num_swapped_out == preemptions, "a preemption did not swap"
    assert sched.num_swapped_in == sched.num_swapped_out


def _on_admission(sched, check) -> None:
    """Call ``check(request, free_before)`` before, and ``check(request, None)``
    after, every allocation that gives blocks to a request not running (an
    admission from the waiting queue, or a swap-in)."""
    manager = sched.kv_cache_manager
    allocate = manager.allocate_slots

    def allocate_slots(request, *args, **kwargs):
        admitting = request.status != RequestStatus.RUNNING
        if admitting:
            check(request, manager.block_pool.get_num_free_blocks())
        blocks = allocate(request, *args, **kwargs)
        if admitting and blocks is not None:
            check(request, None)
        return blocks

    manager.allocate_slots = allocate_slots


@PROPERTY
@given(w=workloads, cpu_extra=st.integers(0, 12), watermark=st.sampled_from([0.1, 0.2, 0.3]))
def test_swap_scheduler_admits_only_above_the_watermark(w, cpu_extra, watermark):
    """v0's watermark: while others run, a request admitted or swapped in
    leaves at least int(watermark * GPU blocks) blocks free; all still finish."""
    sched, requests, arrivals, num_blocks = build(
        SwapScheduler, w, num_cpu_blocks=cpu_extra, watermark=watermark
    )
    watermark_blocks = int(watermark * num_blocks)
    others_ran = []

    def check(request, free_before):
        if free_before is not None:
            others_ran[:] = [bool(sched.running)]
            return
        free = sched.kv_cache_manager.block_pool.get_num_free_blocks()
        assert not others_ran[0] or free >= watermark_blocks, (
            f"{request.request_id} got blocks while others ran, leaving {free} free "
            f"< the watermark's {watermark_blocks}"
        )

    _on_admission(sched, check)
    result = drive(sched, requests, arrivals)
    check_end(sched, requests, result, num_blocks)


@PROPERTY
@given(w=workloads, cpu_extra=st.integers(1, 12))
def test_swapped_requests_resume_before_new_prefills(w, cpu_extra):
    """v0's order within a step: running, then swapped in, then new prefills.
    A request prefilled from scratch (new, or a recompute victim) gets blocks
    only when the oldest swapped request could not come back at that moment."""
    sched, requests, arrivals, num_blocks = build(SwapScheduler, w, num_cpu_blocks=cpu_extra)

    def check(request, free_before):
        from_scratch = (
            request.num_computed_tokens == 0 and request.request_id not in sched.req_to_cpu_blocks
        )
        if free_before is None or not from_scratch or not sched.swapped:
            return
        head, resumed = sched.swapped[0], sched._swapped_in_waiting()
        seat = len(sched.running) + len(resumed) < sched.max_num_running_reqs
        assert not (seat and sched._can_swap_in(head, resumed)), (
            f"{request.request_id} was admitted while {head.request_id} stayed swapped "
            "out with room to come back"
        )

    _on_admission(sched, check)
    result = drive(sched, requests, arrivals)
    check_end(sched, requests, result, num_blocks)


def test_swap_scheduler_swaps_under_memory_pressure():
    """A fixed workload that must preempt: it swaps out and back in."""
    sched, requests, arrivals, num_blocks = build(SwapScheduler, PRESSURE, num_cpu_blocks=32)
    result = drive(sched, requests, arrivals)
    check_end(sched, requests, result, num_blocks)
    assert sched.num_swapped_out > 0 and sched.num_blocks_swapped > 0
    assert sched.num_recompute_preemptions == 0


def test_swap_scheduler_falls_back_to_recompute_without_swap_space():
    sched, requests, arrivals, num_blocks = build(SwapScheduler, PRESSURE, num_cpu_blocks=0)
    result = drive(sched, requests, arrivals)
    check_end(sched, requests, result, num_blocks)
    assert sched.num_swapped_out == 0 and sched.num_recompute_preemptions > 0


@PROPERTY
@given(w=workloads)
def test_prefill_first_never_mixes_and_loses_nothing(w):
    sched, requests, arrivals, num_blocks = build(PrefillFirstScheduler, w)

    def never_mixed(step, kinds, *_):
        assert len(kinds) <= 1, f"step {step} mixed prefills and decodes"

    result = drive(sched, requests, arrivals, never_mixed)
    check_end(sched, requests, result, num_blocks)


def test_the_default_scheduler_does_mix():
    """The property above can fail: v1's own scheduler mixes steps."""
    w = {
        "block_size": 4,
        "max_num_seqs": 4,
        "budget": 64,
        "chunked": True,
        "caching": False,
        "extra_blocks": 10,
        "reqs": [(10, 6, 0), (10, 6, 2)],
        "shared_prefix": False,
    }
    sched, requests, arrivals, _ = build(Scheduler, w)
    mixed = []
    drive(sched, requests, arrivals, lambda step, kinds, *_: mixed.append(len(kinds) > 1))
    assert any(mixed)


def test_swap_scheduler_refuses_what_it_cannot_swap():
    for kwargs, field in (({"policy": "priority"}, "policy"), ({"kv_groups": [None, 4]}, "group")):
        with pytest.raises(ValueError, match=field):
            mini.create_scheduler(scheduler_cls=SwapScheduler, **kwargs)


# ------------------------------------------------------------ real weights


def _equal_tokens_under_pressure(path, vocab):
    prompts = pressure_prompts(vocab)
    want, ref = greedy(path, None, prompts)
    assert ref.kv_cache_manager is not None
    swap_tokens, swap = greedy(path, SwapScheduler, prompts, num_cpu_blocks=16)
    assert swap.num_swapped_out > 0, "the cache was meant to be too small"
    assert swap_tokens == want
    first_tokens, first = greedy(path, PrefillFirstScheduler, prompts)
    assert first.num_prefill_steps > 0 and first.num_decode_steps > 0
    assert first_tokens == want


def test_variants_equal_the_default_scheduler_greedy_tiny(tiny_qwen3):
    path, hf = tiny_qwen3
    _equal_tokens_under_pressure(path, hf.config.vocab_size)


@pytest.mark.gpu
def test_the_swap_space_is_pinned_on_cuda(tiny_qwen3):
    """On CUDA the CPU swap space is page-locked (v0's CacheEngine pinned it);
    on a CPU-only machine the tiny test above runs the same code unpinned."""
    from mini_vllm.entrypoints.llm import LLM
    from mini_vllm.sampling_params import SamplingParams

    path, hf = tiny_qwen3
    prompts = pressure_prompts(hf.config.vocab_size)
    want, _ = greedy(path, None, prompts, device="cuda")
    llm = LLM(
        path,
        max_model_len=96,
        num_gpu_blocks_override=8,
        block_size=16,
        scheduler_cls=SwapScheduler,
        num_cpu_blocks=16,
        device="cuda",
    )
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert llm.llm_engine.engine_core.scheduler.num_swapped_out > 0
    cpu_kv_caches = llm.llm_engine.engine_core.model_runner.cpu_kv_caches
    assert cpu_kv_caches and all(t.is_pinned() for t in cpu_kv_caches)


@pytest.mark.deep
def test_variants_equal_the_default_scheduler_greedy_smollm2(smollm2_hf):
    path, hf = smollm2_hf
    _equal_tokens_under_pressure(str(path), hf.config.vocab_size)


def test_prefill_first_decode_step_leaves_a_stalled_prefill_out():
    """Without the full-prompt reservation a prefill can stall mid-prompt for
    want of blocks while others decode: a decode step must not run its chunk."""
    w = {
        "block_size": 2,
        "max_num_seqs": 2,
        "budget": 8,
        "chunked": True,
        "caching": False,
        "extra_blocks": 0,
        "reqs": [(17, 2, 0), (15, 1, 0)],
        "shared_prefix": False,
        "reserve_full_isl": False,
    }
    sched, requests, arrivals, num_blocks = build(PrefillFirstScheduler, w)

    def never_mixed(step, kinds, *_):
        assert len(kinds) <= 1, f"step {step} mixed prefills and decodes"

    result = drive(sched, requests, arrivals, never_mixed)
    check_end(sched, requests, result, num_blocks)


def test_a_negative_swap_space_is_one_clear_error_whatever_the_scheduler():
    from mini_vllm.config import CacheConfig

    with pytest.raises(ValueError, match=r"num_cpu_blocks must be >= 0, got -1\."):
        CacheConfig(num_cpu_blocks=-1).verify()
    CacheConfig(num_cpu_blocks=0).verify()


def test_a_watermark_outside_0_1_is_one_clear_error():
    from mini_vllm.config import CacheConfig

    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match=rf"watermark must be in \[0, 1\), got {bad}\."):
            CacheConfig(watermark=bad).verify()
    CacheConfig(watermark=0.0).verify()
