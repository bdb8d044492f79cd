"""Live lockstep: mini_vllm's scheduler and the pinned upstream's, step for step.

Hypothesis generates configurations (block size, few to many blocks, token
budget, max_num_seqs, chunked prefill and prefix caching on or off, long
prefill threshold, FCFS or PRIORITY, the full-prompt admission gate) and
workloads (request counts and lengths, shared prefixes, priorities, staggered
arrivals, EOS and stop tokens at chosen outputs, min_tokens, ignore_eos,
aborts, max_model_len caps). Both schedulers get the same requests and the
same fake-model tokens; every step's SchedulerOutput, the update_from_output
results, the free-block count and each request's final state must be equal.
A failure names the first step and field that differ.

MINI_VLLM_LOCKSTEP_EXAMPLES sets the number of generated cases (default 2000).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mini_vllm.testing as mini
from mini_vllm.core.kv_cache_manager import cdiv
from mini_vllm.oracle.workload import RequestSpec, Workload, first_difference, run_workload

pytestmark = pytest.mark.upstream

EXAMPLES = int(os.environ.get("MINI_VLLM_LOCKSTEP_EXAMPLES", "2000"))


@pytest.fixture(scope="module")
def upstream():
    from mini_vllm.oracle import upstream as up
    return up


@st.composite
def scheduler_configs(draw) -> dict:
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    max_model_len = draw(st.integers(8, 200))
    chunked = draw(st.booleans())
    max_num_seqs = draw(st.sampled_from([1, 2, 4, 8, 12, 16]))
    # Upstream's SchedulerConfig demands budget >= max_num_seqs, and budget >=
    # max_model_len when chunked prefill is off.
    low = max(max_num_seqs, 1 if chunked else max_model_len)
    budget = draw(st.integers(low, max(low, 320)))
    # From "exactly one max_model_len request fits" to plenty, weighted
    # toward tight caches so that preemption is common.
    min_blocks = cdiv(max_model_len, block_size) + 1
    num_blocks = draw(st.integers(min_blocks, min_blocks + 3)
                      | st.integers(min_blocks, 2 * min_blocks)
                      | st.integers(min_blocks, 6 * min_blocks))
    return {
        "block_size": block_size,
        "max_model_len": max_model_len,
        "enable_chunked_prefill": chunked,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": budget,
        "num_blocks": num_blocks,
        "long_prefill_token_threshold": draw(st.sampled_from([0, 0, 1, 3, 8, 32])),
        "enable_prefix_caching": draw(st.booleans()),
        "policy": draw(st.sampled_from(["fcfs", "priority"])),
        "scheduler_reserve_full_isl": draw(st.booleans()),
    }


@st.composite
def workloads(draw) -> Workload:
    config = draw(scheduler_configs())
    max_model_len = config["max_model_len"]
    prefixes = draw(st.lists(
        st.lists(st.integers(1, 999), min_size=1, max_size=48), min_size=0, max_size=3))
    n = draw(st.integers(1, 4) | st.integers(4, 20))
    requests = []
    for i in range(n):
        prefix = draw(st.sampled_from(prefixes)) if prefixes and draw(st.booleans()) else []
        suffix = draw(st.lists(st.integers(1, 999), min_size=0, max_size=64))
        prompt = (prefix + suffix)[: max_model_len - 1] or [draw(st.integers(1, 999))]
        max_tokens = draw(st.integers(1, 64))
        stop = draw(st.sampled_from([[], [], [7], [7, 9]]))
        requests.append(RequestSpec(
            req_id=f"req-{i}",
            prompt_token_ids=prompt,
            max_tokens=max_tokens,
            arrive_step=draw(st.sampled_from([0, 0, 0, 1, 2, 5, 12])),
            priority=draw(st.integers(0, 3)),
            # min_tokens must fit: len(prompt) + min_tokens <= max_model_len
            # (upstream livelocks otherwise; see the test below).
            min_tokens=min(draw(st.sampled_from([0, 0, 0, 1, 4])), max_tokens,
                           max_model_len - len(prompt)),
            ignore_eos=draw(st.booleans()),
            stop_token_ids=stop,
            eos_at=draw(st.sampled_from([None, None, None, 0, 1, 5, 20])),
            stop_at=draw(st.sampled_from([None, None, 0, 3, 15])) if stop else None,
            abort_step=draw(st.none() | st.none() | st.none() | st.integers(0, 20)),
        ))
    return Workload(name="generated", config=config, requests=requests)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(workload=workloads())
def test_lockstep_with_upstream(upstream, counts, workload):
    expected = run_workload(upstream, workload)
    got = run_workload(mini, workload)
    counts["lockstep examples"] = counts.get("lockstep examples", 0) + 1
    counts["lockstep steps"] = counts.get("lockstep steps", 0) + len(expected["steps"])
    preempted = sum(len(s["preempted"]) for s in expected["steps"])
    counts["lockstep preemptions"] = counts.get("lockstep preemptions", 0) + preempted
    counts["lockstep examples with preemption"] = (
        counts.get("lockstep examples with preemption", 0) + (preempted > 0))
    diff = first_difference(expected, got)
    assert diff is None, f"{diff}\nconfig: {workload.config}"


def test_generated_workloads_exercise_preemption(counts):
    """The generator must reach memory pressure, or the lockstep proves little
    about preemption. Runs after the lockstep test in this module."""
    if counts.get("lockstep examples", 0) < 50:
        pytest.skip("too few lockstep examples ran to judge coverage")
    assert counts["lockstep examples with preemption"] > 0, counts


def test_block_hashes_equal_upstream(upstream):
    """mini_vllm's block hashes are byte-identical to upstream's (both seeded
    with sha256("0")), including hashes of blocks completed by outputs."""
    prompt = list(range(1, 38))
    (m,) = mini.create_requests(1, prompt_token_ids=[prompt], block_size=8)
    (u,) = upstream.create_requests(1, prompt_token_ids=[prompt], block_size=8)
    assert m.block_hashes == u.block_hashes and len(m.block_hashes) == 4
    for tok in (5, 6, 7):
        m.append_output_token_ids(tok)
        u.append_output_token_ids(tok)
    assert m.block_hashes == u.block_hashes and len(m.block_hashes) == 5


def test_upstream_livelocks_when_min_tokens_cannot_fit(upstream):
    """Why mini_vllm rejects len(prompt) + min_tokens > max_model_len.

    Upstream (v0.22.1) accepts such a request. check_stop() returns early
    while min_tokens is unmet, so the max_model_len stop never fires; and
    schedule() clamps new tokens to max_model_len - 1 - num_computed_tokens,
    which reaches 0, so the request is skipped (scheduler.py:438) forever.
    """
    sched = upstream.create_scheduler(max_model_len=8, max_num_batched_tokens=8, max_num_seqs=4,
                                      num_blocks=16, block_size=4)
    (req,) = upstream.create_requests(1, num_tokens=5, max_tokens=4, min_tokens=4, block_size=4)
    sched.add_request(req)
    for _ in range(20):
        out = sched.schedule()
        runner = mini.make_model_runner_output(sched, out, lambda r: 1234,
                                               output_cls=upstream.ModelRunnerOutput)
        sched.update_from_output(out, runner)
    assert not req.is_finished() and req.num_tokens == 8
    assert sched.schedule().total_num_scheduled_tokens == 0  # stuck for good

    mini_sched = mini.create_scheduler(max_model_len=8, max_num_batched_tokens=8, max_num_seqs=4,
                                       num_blocks=16, block_size=4)
    (mini_req,) = mini.create_requests(1, num_tokens=5, max_tokens=4, min_tokens=4, block_size=4)
    with pytest.raises(ValueError, match="min_tokens"):
        mini_sched.add_request(mini_req)
