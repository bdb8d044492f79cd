"""Lab 01 (19.1) — preemption by swapping, vLLM v0's way, on v1's scheduler.

Graded: the ``LAB 19.1`` regions of ``labs/phase_19/swap_scheduler.py``.

Your ``SwapScheduler`` runs generated workloads with a fake model while a
fake KV cache keeps in every GPU and CPU block the token ids written there
(``mini_vllm/grading/variant_checks.py``): each step's swap maps are copied
before the "forward", and every scheduled request must find its computed
tokens in its blocks. Graded: nothing lost and every block back in both
pools; swaps happen, and never a recompute while the swap space is free;
the swap maps consistent at every step; recompute when there is no swap
space; and on a tiny real model under memory pressure, greedy tokens equal
to v1's own scheduler's.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mini_vllm.grading import variant_checks as V
from mini_vllm.grading.checks import lab_settings
from mini_vllm.kv_cache_interface import cdiv

pytestmark = pytest.mark.timeout(60)

PROPERTY = lab_settings(40)


def swap_class(impl):
    return impl.swap_scheduler.SwapScheduler


@pytest.mark.points(4)
@PROPERTY
@given(w=V.workloads, cpu_blocks=st.integers(0, 12))
def test_nothing_lost_and_every_block_back_in_both_pools(impl, w, cpu_blocks):
    sched, requests, arrivals, num_blocks = V.build(swap_class(impl), w, cpu_blocks)
    result = V.drive(sched, requests, arrivals)
    V.check_end(sched, requests, result, num_blocks)
    assert sorted(sched.free_cpu_block_ids) == list(range(cpu_blocks)), (
        f"at the end the CPU pool's free list is {sorted(sched.free_cpu_block_ids)}, "
        f"want every one of its {cpu_blocks} blocks once: _swap_in must give a "
        "request's CPU blocks back"
    )
    assert not sched.swapped and not sched.req_to_cpu_blocks, (
        "requests were left swapped out at the end"
    )


@pytest.mark.points(4)
@PROPERTY
@given(w=V.workloads)
def test_swaps_and_never_recomputes_while_swap_space_is_free(impl, w):
    # CPU space for the whole GPU pool: every victim fits.
    sched, requests, arrivals, num_blocks = V.build(swap_class(impl), w, num_cpu_blocks=64)
    result = V.drive(sched, requests, arrivals)
    V.check_end(sched, requests, result, num_blocks)
    preemptions = sum(r.num_preemptions for r in requests)
    assert sched.num_recompute_preemptions == 0, (
        f"{sched.num_recompute_preemptions} victims were recomputed while 64 CPU blocks "
        "were free: a victim goes to the CPU pool whenever its filled blocks fit"
    )
    assert sched.num_swapped_out == preemptions, (
        f"{preemptions} preemptions but {sched.num_swapped_out} swaps out: "
        "every preemption must swap (and count num_swapped_out)"
    )
    assert sched.num_swapped_in == sched.num_swapped_out, (
        f"{sched.num_swapped_out} swapped out, {sched.num_swapped_in} swapped back in"
    )


@pytest.mark.points(3)
@PROPERTY
@given(w=V.workloads, cpu_blocks=st.integers(0, 12))
def test_the_swap_maps_are_consistent_at_every_step(impl, w, cpu_blocks):
    sched, requests, arrivals, num_blocks = V.build(swap_class(impl), w, cpu_blocks)

    def before(step):
        # Before this step's schedule(): each running request's GPU blocks and
        # computed tokens, and how many CPU blocks are free.
        blocks = {
            r.request_id: list(sched.kv_cache_manager.get_block_ids(r.request_id)[0])
            for r in sched.running
        }
        computed = {r.request_id: r.num_computed_tokens for r in sched.running}
        return blocks, computed, len(sched.free_cpu_block_ids)

    def check(step, kinds, out, seen):
        gpu_before, computed_before, free_before = seen
        for req_id in out.preempted_req_ids:
            if req_id in sched.req_to_cpu_blocks:
                continue
            # Recomputed: the CPU pool must have been too small for it then,
            # even counting every block the step swapped out as still free.
            needed = cdiv(computed_before[req_id], sched.block_size)
            room = free_before - len(out.blocks_to_swap_out)
            assert needed == 0 or needed > room, (
                f"step {step}: {req_id} was recomputed, yet its {needed} filled blocks "
                f"fit the {room} CPU blocks free: a victim is swapped whenever it fits"
            )
        cpu_out = [c for _, c in out.blocks_to_swap_out]
        cpu_in = [c for c, _ in out.blocks_to_swap_in]
        assert not (out.blocks_to_swap_out and out.blocks_to_swap_in), (
            f"step {step} swaps both ways: a step that preempted swaps nothing in (v0's rule)"
        )
        for req_id in out.preempted_req_ids:
            if req_id in sched.req_to_cpu_blocks:
                cpu = sched.req_to_cpu_blocks[req_id]
                request = sched.requests[req_id]
                want = cdiv(request.num_computed_tokens, sched.block_size)
                pairs = [(g, c) for g, c in out.blocks_to_swap_out if c in cpu]
                assert len(cpu) == want, (
                    f"step {step}: {req_id} has {request.num_computed_tokens} computed tokens, "
                    f"{want} blocks to keep, but {len(cpu)} CPU blocks"
                )
                assert [g for g, _ in pairs] == gpu_before[req_id][:want], (
                    f"step {step}: {req_id} swapped out GPU blocks {[g for g, _ in pairs]}, "
                    f"want its first {want} blocks {gpu_before[req_id][:want]} in order"
                )
        in_use = [c for blocks in sched.req_to_cpu_blocks.values() for c in blocks]
        every = sorted(in_use + list(sched.free_cpu_block_ids))
        assert every == list(range(cpu_blocks)), (
            f"step {step}: the CPU blocks held by swapped requests plus the free list are "
            f"{every}, want each of range({cpu_blocks}) once"
        )
        assert len(set(cpu_out)) == len(cpu_out) and set(cpu_out) <= set(in_use), (
            f"step {step}: blocks_to_swap_out's CPU blocks {cpu_out} must be distinct and "
            "now held by the swapped requests"
        )
        assert len(set(cpu_in)) == len(cpu_in) and not set(cpu_in) & set(in_use), (
            f"step {step}: blocks_to_swap_in's CPU blocks {cpu_in} must be distinct and "
            "back in the free list"
        )
        swapped_ids = {r.request_id for r in sched.swapped}
        assert swapped_ids == set(sched.req_to_cpu_blocks), (
            f"step {step}: swapped {sorted(swapped_ids)} but CPU blocks held for "
            f"{sorted(sched.req_to_cpu_blocks)}"
        )

    result = V.drive(sched, requests, arrivals, check, before)
    V.check_end(sched, requests, result, num_blocks)


@pytest.mark.points(2)
def test_a_workload_under_memory_pressure_swaps_out_and_back_in(impl):
    sched, requests, arrivals, num_blocks = V.build(swap_class(impl), V.PRESSURE, 32)
    result = V.drive(sched, requests, arrivals)
    V.check_end(sched, requests, result, num_blocks)
    assert sched.num_swapped_out > 0 and sched.num_blocks_swapped > 0, (
        "four requests in a pool that holds one: someone must be swapped out "
        "(and num_swapped_out, num_blocks_swapped counted)"
    )
    assert sched.num_swapped_in == sched.num_swapped_out
    assert sched.num_recompute_preemptions == 0


@pytest.mark.points(2)
def test_without_swap_space_a_victim_is_recomputed(impl):
    sched, requests, arrivals, num_blocks = V.build(swap_class(impl), V.PRESSURE, 0)
    result = V.drive(sched, requests, arrivals)
    V.check_end(sched, requests, result, num_blocks)
    assert sched.num_swapped_out == 0 and sched.num_recompute_preemptions > 0, (
        f"no CPU blocks: {sched.num_swapped_out} swaps out and "
        f"{sched.num_recompute_preemptions} recomputes; every victim must be recomputed"
    )


@pytest.mark.points(5)
@pytest.mark.timeout(240)
def test_greedy_tokens_equal_the_default_schedulers(
    impl, request, tiny_qwen3_folder, pressure_prompts
):
    got, sched = V.greedy(tiny_qwen3_folder, swap_class(impl), pressure_prompts, num_cpu_blocks=16)
    want = request.getfixturevalue("default_greedy")
    assert sched.num_swapped_out > 0, "7 blocks for four growing requests: nobody swapped out"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, (
            f"prompt {i}: greedy tokens {g} differ from v1's scheduler's {w}: "
            "the KV copied back in is not the KV swapped out"
        )
