"""Invariants of mini_vllm's scheduler under random use (hypothesis, no upstream).

A state machine adds requests (some sharing prefixes), runs steps with a
fake model, and aborts requests at random. After every action it checks:
- blocks are conserved: every usable block is either free or held, and a
  block's ref count equals the number of requests holding it;
- no step exceeds the token budget or max_num_seqs;
- every request finishes exactly once, with exactly the tokens it was fed;
- once every request is done, all blocks are free with ref count 0.
A second property: output tokens do not depend on memory pressure.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import mini_vllm.testing as mini
from mini_vllm.kv_cache_interface import cdiv
from mini_vllm.oracle.workload import RequestSpec, Workload, fake_token, run_workload
from mini_vllm.request import RequestStatus

PREFIXES = [[5] * 12, [6] * 20]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([2, 4, 8]),
        max_model_len=st.integers(16, 64),
        extra_blocks=st.integers(0, 20),
        max_num_seqs=st.integers(1, 6),
        chunked=st.booleans(),
        caching=st.booleans(),
        policy=st.sampled_from(["fcfs", "priority"]),
        threshold=st.sampled_from([0, 0, 5]),
    )
    def setup(
        self,
        block_size,
        max_model_len,
        extra_blocks,
        max_num_seqs,
        chunked,
        caching,
        policy,
        threshold,
    ):
        self.budget = max(max_num_seqs, max_model_len if not chunked else 16)
        self.num_blocks = cdiv(max_model_len, block_size) + 1 + extra_blocks
        self.sched = mini.create_scheduler(
            block_size=block_size,
            max_model_len=max_model_len,
            num_blocks=self.num_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=self.budget,
            enable_chunked_prefill=chunked,
            enable_prefix_caching=caching,
            policy=policy,
            long_prefill_token_threshold=threshold,
        )
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.specs: dict[str, RequestSpec] = {}
        self.objects = {}
        self.finish_events: Counter[str] = Counter()
        self.counter = 0

    @rule(
        prefix=st.sampled_from([[]] + PREFIXES),
        suffix=st.lists(st.integers(1, 99), max_size=30),
        max_tokens=st.integers(1, 20),
        priority=st.integers(0, 2),
        eos_at=st.none() | st.integers(0, 5),
    )
    def add(self, prefix, suffix, max_tokens, priority, eos_at):
        prompt = (prefix + suffix)[: self.max_model_len - 1] or [1]
        req_id = f"r{self.counter}"
        self.counter += 1
        spec = RequestSpec(req_id, prompt, max_tokens=max_tokens, priority=priority, eos_at=eos_at)
        (request,) = mini.create_requests(
            1,
            prompt_token_ids=[prompt],
            max_tokens=max_tokens,
            req_ids=[req_id],
            priorities=[priority],
            arrival_times=[float(self.counter)],
            block_size=self.block_size,
        )
        self.sched.add_request(request)
        self.specs[req_id] = spec
        self.objects[req_id] = request

    @rule()
    def step(self):
        out = self.sched.schedule()
        assert out.total_num_scheduled_tokens <= self.budget
        assert sum(out.num_scheduled_tokens.values()) == out.total_num_scheduled_tokens
        assert len(out.num_scheduled_tokens) <= self.max_num_seqs
        assert len(self.sched.running) <= self.max_num_seqs
        runner = mini.make_model_runner_output(
            self.sched,
            out,
            lambda r: fake_token(self.specs[r.request_id], r.num_output_tokens, mini.EOS_TOKEN_ID),
        )
        result = self.sched.update_from_output(out, runner)
        for o in result.outputs:
            if o.finished:
                self.finish_events[o.request_id] += 1

    @precondition(lambda self: any(not r.is_finished() for r in self.objects.values()))
    @rule(data=st.data())
    def abort(self, data):
        alive = sorted(k for k, r in self.objects.items() if not r.is_finished())
        req_id = data.draw(st.sampled_from(alive))
        assert self.sched.finish_requests(req_id, RequestStatus.FINISHED_ABORTED) == [req_id]
        self.finish_events[req_id] += 1
        # A second abort is a no-op.
        assert self.sched.finish_requests(req_id, RequestStatus.FINISHED_ABORTED) == []

    @invariant()
    def blocks_conserved_and_ref_counts_match_holders(self):
        if not hasattr(self, "sched"):
            return
        kv = self.sched.kv_cache_manager
        pool = kv.block_pool
        holders = Counter(b.block_id for blocks in kv.req_to_blocks.values() for b in blocks)
        free_ids = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        assert len(free_ids) == pool.get_num_free_blocks()
        assert 0 not in free_ids, "the null block must never be free"
        assert len(set(free_ids)) == len(free_ids)
        assert set(free_ids).isdisjoint(holders), "a held block is in the free queue"
        assert len(free_ids) + len(holders) == self.num_blocks - 1, "a block was lost"
        for block in pool.blocks[1:]:
            assert block.ref_cnt == holders.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but "
                f"{holders.get(block.block_id, 0)} holders"
            )
        # Only live (unfinished) requests hold blocks.
        assert set(kv.req_to_blocks) <= set(self.sched.requests)

    @invariant()
    def finished_once_with_the_tokens_it_was_fed(self):
        if not hasattr(self, "sched"):
            return
        assert all(n == 1 for n in self.finish_events.values()), self.finish_events
        for req_id, request in self.objects.items():
            expected = [
                fake_token(self.specs[req_id], i, mini.EOS_TOKEN_ID)
                for i in range(request.num_output_tokens)
            ]
            assert request.output_token_ids == expected
            assert (req_id in self.finish_events) == request.is_finished()

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(10_000):
            if not self.sched.has_requests():
                break
            self.step()
        assert not self.sched.has_requests(), "the scheduler did not drain"
        pool = self.sched.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == self.num_blocks - 1
        assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
        assert self.sched.requests == {} and not self.sched.running and not self.sched.waiting
        assert all(self.finish_events[r] == 1 for r in self.objects)


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@st.composite
def pressure_workloads(draw):
    block_size = draw(st.sampled_from([2, 4, 8]))
    max_model_len = draw(st.integers(16, 80))
    n = draw(st.integers(2, 10))
    requests = []
    for i in range(n):
        prompt = draw(st.lists(st.integers(1, 99), min_size=1, max_size=max_model_len - 1))
        requests.append(
            RequestSpec(
                f"r{i}",
                prompt,
                max_tokens=draw(st.integers(1, 30)),
                arrive_step=draw(st.integers(0, 4)),
                priority=draw(st.integers(0, 2)),
                eos_at=draw(st.none() | st.integers(0, 8)),
            )
        )
    config = dict(
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_seqs=8,
        max_num_batched_tokens=draw(st.integers(8, 128)),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        enable_prefix_caching=draw(st.booleans()),
    )
    return Workload("pressure", config, requests), cdiv(max_model_len, block_size) + 1


@settings(max_examples=150, deadline=None)
@given(pressure_workloads())
def test_outputs_do_not_depend_on_memory_pressure(case):
    """The same requests give the same tokens and finish reasons whether the
    cache is ample or so small that preemption happens."""
    workload, min_blocks = case
    ample = Workload("ample", dict(workload.config, num_blocks=10_000), workload.requests)
    tight = Workload("tight", dict(workload.config, num_blocks=min_blocks), workload.requests)
    a, t = run_workload(mini, ample)["final"], run_workload(mini, tight)["final"]
    assert a.keys() == t.keys()
    for req_id in a:
        assert a[req_id]["output_token_ids"] == t[req_id]["output_token_ids"], req_id
        assert a[req_id]["status"] == t[req_id]["status"], req_id
