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
from mini_vllm.kv_cache_interface import cdiv
from mini_vllm.tiers import examples

MAX_STEPS = 2000


class FakeKV:
    """Token ids in place of KV: ``gpu[block][slot]`` and ``cpu[block][slot]``."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.gpu: dict[int, list] = {}
        self.cpu: dict[int, list] = {}

    def swap(self, out) -> None:
        for gpu_block, cpu_block in getattr(out, "blocks_to_swap_out", ()):
            self.cpu[cpu_block] = list(self.gpu.get(gpu_block, [None] * self.block_size))
        for cpu_block, gpu_block in getattr(out, "blocks_to_swap_in", ()):
            self.gpu[gpu_block] = list(self.cpu[cpu_block])

    def run(self, request, block_ids: list[int], start: int, num_new: int, step: int) -> None:
        """Check tokens [0, start) are in place, then write [start, start + num_new)."""
        tokens = request.all_token_ids
        for pos in range(start + num_new):
            block = self.gpu.setdefault(block_ids[pos // self.block_size], [None] * self.block_size)
            slot = pos % self.block_size
            if pos < start:
                assert block[slot] == tokens[pos], (
                    f"step {step}: {request.request_id} lost its KV at position {pos} "
                    f"(block {block_ids[pos // self.block_size]} holds {block[slot]}, "
                    f"want {tokens[pos]})"
                )
            elif pos < len(tokens):
                block[slot] = tokens[pos]


def is_decode(request, start: int, admitted: bool) -> bool:
    """A decode: a running request with everything before its last token
    computed. A request admitted this step (new, or resumed from the waiting
    queue) prefills, even when its prefix cache hits leave one token."""
    return not admitted and start >= max(request.num_prompt_tokens, request.num_tokens - 1)


def drive(sched, requests, arrivals, check_step=None) -> dict:
    """Run to the end with a fake model; returns per-request outputs and stats."""
    kv = FakeKV(sched.block_size)
    outputs = {r.request_id: [] for r in requests}
    pending = sorted(zip(arrivals, range(len(requests)), strict=True))
    step = 0
    while pending or sched.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            sched.add_request(requests[pending.pop(0)[1]])
        out = sched.schedule()
        assert out.total_num_scheduled_tokens <= sched.max_num_scheduled_tokens, (
            f"step {step}: {out.total_num_scheduled_tokens} tokens over the budget"
        )
        assert len(sched.running) <= sched.scheduler_config.max_num_seqs, (
            f"step {step}: {len(sched.running)} running > max_num_seqs"
        )
        kv.swap(out)
        kinds = set()
        admitted = {r.req_id for r in out.scheduled_new_reqs}
        admitted |= set(out.scheduled_cached_reqs.resumed_req_ids)
        for req_id, n in out.num_scheduled_tokens.items():
            request = sched.requests[req_id]
            start = request.num_computed_tokens - n
            kinds.add(is_decode(request, start, req_id in admitted))
            block_ids = sched.kv_cache_manager.get_block_ids(req_id)[0]
            kv.run(request, block_ids, start, n, step)
        if check_step is not None:
            check_step(step, kinds)
        runner_output = mini.make_model_runner_output(
            sched, out, lambda r: 1000 + len(r.output_token_ids)
        )
        sched.update_from_output(out, runner_output)
        for request_id, tokens in zip(
            runner_output.req_ids, runner_output.sampled_token_ids, strict=True
        ):
            if tokens:
                outputs[request_id].extend(tokens)
        step += 1
        assert step < MAX_STEPS, f"no end after {MAX_STEPS} steps"
    return {"outputs": outputs, "steps": step}


workloads = st.fixed_dictionaries(
    {
        "block_size": st.sampled_from([2, 4]),
        "max_num_seqs": st.integers(1, 6),
        "budget": st.sampled_from([8, 16, 64]),
        "chunked": st.booleans(),
        "caching": st.booleans(),
        "extra_blocks": st.integers(0, 12),
        "reqs": st.lists(
            st.tuples(st.integers(1, 20), st.integers(1, 12), st.integers(0, 6)),
            min_size=1,
            max_size=10,
        ),
        "shared_prefix": st.booleans(),
        "reserve_full_isl": st.booleans(),
    }
)


def build(cls, w, num_cpu_blocks: int | None = None):
    max_model_len = 32
    num_blocks = cdiv(max_model_len, w["block_size"]) + 1 + w["extra_blocks"]
    budget = w["budget"] if w["chunked"] else max(w["budget"], max_model_len)
    config = mini.create_scheduler(
        block_size=w["block_size"],
        max_model_len=max_model_len,
        num_blocks=num_blocks,
        max_num_seqs=w["max_num_seqs"],
        max_num_batched_tokens=max(budget, w["max_num_seqs"]),
        enable_chunked_prefill=w["chunked"],
        enable_prefix_caching=w["caching"],
        scheduler_reserve_full_isl=w.get("reserve_full_isl", True),
    ).vllm_config
    config.cache_config.num_cpu_blocks = num_cpu_blocks
    sched = cls(config, log_stats=True)
    prompts, max_tokens, arrivals = [], [], []
    for i, (prompt_len, out_len, arrive) in enumerate(w["reqs"]):
        head = [7] * 6 if w["shared_prefix"] else []
        prompt = (head + [100 + i] * prompt_len)[: max_model_len - out_len]
        prompts.append(prompt)
        max_tokens.append(out_len)
        arrivals.append(arrive)
    requests = []
    for prompt, n in zip(prompts, max_tokens, strict=True):
        (req,) = mini.create_requests(
            1,
            prompt_token_ids=[prompt],
            max_tokens=n,
            ignore_eos=True,
            block_size=w["block_size"],
            req_ids=[f"r{len(requests)}"],
        )
        requests.append(req)
    return sched, requests, arrivals, num_blocks


def check_end(sched, requests, result, num_blocks):
    for r in requests:
        assert len(result["outputs"][r.request_id]) == r.max_tokens, (
            f"{r.request_id} got {len(result['outputs'][r.request_id])} tokens, "
            f"asked {r.max_tokens}"
        )
        assert r.is_finished()
    free = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    assert free == num_blocks - 1, f"{num_blocks - 1 - free} GPU blocks never came back"


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


def test_swap_scheduler_swaps_under_memory_pressure():
    """A fixed workload that must preempt: it swaps out and back in."""
    w = {
        "block_size": 4,
        "max_num_seqs": 4,
        "budget": 64,
        "chunked": True,
        "caching": False,
        "extra_blocks": 0,
        "reqs": [(10, 12, 0)] * 4,
        "shared_prefix": False,
    }
    sched, requests, arrivals, num_blocks = build(SwapScheduler, w, num_cpu_blocks=32)
    result = drive(sched, requests, arrivals)
    check_end(sched, requests, result, num_blocks)
    assert sched.num_swapped_out > 0 and sched.num_blocks_swapped > 0
    assert sched.num_recompute_preemptions == 0


def test_swap_scheduler_falls_back_to_recompute_without_swap_space():
    w = {
        "block_size": 4,
        "max_num_seqs": 4,
        "budget": 64,
        "chunked": True,
        "caching": False,
        "extra_blocks": 0,
        "reqs": [(10, 12, 0)] * 4,
        "shared_prefix": False,
    }
    sched, requests, arrivals, num_blocks = build(SwapScheduler, w, num_cpu_blocks=0)
    result = drive(sched, requests, arrivals)
    check_end(sched, requests, result, num_blocks)
    assert sched.num_swapped_out == 0 and sched.num_recompute_preemptions > 0


@PROPERTY
@given(w=workloads)
def test_prefill_first_never_mixes_and_loses_nothing(w):
    sched, requests, arrivals, num_blocks = build(PrefillFirstScheduler, w)

    def never_mixed(step, kinds):
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
    drive(sched, requests, arrivals, lambda step, kinds: mixed.append(len(kinds) > 1))
    assert any(mixed)


def test_swap_scheduler_refuses_what_it_cannot_swap():
    for kwargs, field in (({"policy": "priority"}, "policy"), ({"kv_groups": [None, 4]}, "group")):
        with pytest.raises(ValueError, match=field):
            mini.create_scheduler(scheduler_cls=SwapScheduler, **kwargs)


# ------------------------------------------------------------ real weights


def _greedy(path, cls, prompts, **kwargs):
    from mini_vllm.entrypoints.llm import LLM
    from mini_vllm.sampling_params import SamplingParams

    llm = LLM(
        path,
        max_model_len=96,
        num_gpu_blocks_override=8,
        block_size=16,
        scheduler_cls=cls,
        **kwargs,
    )
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.llm_engine.engine_core.scheduler


def _equal_tokens_under_pressure(path, vocab):
    # 7 usable blocks of 16 tokens for four 40-token prompts that grow by 24.
    prompts = [[(7 * i + 13 * j) % vocab for j in range(40)] for i in range(4)]
    want, ref = _greedy(path, None, prompts)
    assert ref.kv_cache_manager is not None
    swap_tokens, swap = _greedy(path, SwapScheduler, prompts, num_cpu_blocks=16)
    assert swap.num_swapped_out > 0, "the cache was meant to be too small"
    assert swap_tokens == want
    first_tokens, first = _greedy(path, PrefillFirstScheduler, prompts)
    assert first.num_prefill_steps > 0 and first.num_decode_steps > 0
    assert first_tokens == want


def test_variants_equal_the_default_scheduler_greedy_tiny(tiny_qwen3):
    path, hf = tiny_qwen3
    _equal_tokens_under_pressure(path, hf.config.vocab_size)


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

    def never_mixed(step, kinds):
        assert len(kinds) <= 1, f"step {step} mixed prefills and decodes"

    result = drive(sched, requests, arrivals, never_mixed)
    check_end(sched, requests, result, num_blocks)
