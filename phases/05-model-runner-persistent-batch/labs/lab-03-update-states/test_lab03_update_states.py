"""Lab 05.3 — _update_states: the scheduler's deltas applied to the runner's batch.

Graded: the ``LAB 05.3`` regions of ``labs/phase_05/gpu_model_runner.py``
(``GPUModelRunner._update_states``: who leaves the batch, new requests,
running and resumed requests).

First the rules on hand-written SchedulerOutputs (a new request joins whole
with its own copy of its blocks, a running one gets its computed count and
new blocks in place, finished ones are forgotten, unscheduled ones keep their
state outside the batch, a resumed one's blocks are replaced, a request left
out of a step comes back with its blocks extended), then the pinned upstream
scheduler's real outputs (mini_vllm/oracle/runner_workload.py: named
scenarios with chunked prefill, prefix caching, preemption and resumption,
aborts, stop tokens; then generated workloads) through your runner and
through a replay of upstream's ``_update_states`` on upstream's
``InputBatch``, compared after every step.
"""

from __future__ import annotations

import pytest
from hypothesis import given

from mini_vllm.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from mini_vllm.grading.checks import lab_settings
from mini_vllm.oracle.runner_workload import (
    UpstreamRunnerSide,
    first_runner_difference,
    run_runner_workload,
)
from mini_vllm.oracle.scenarios import SCENARIOS
from mini_vllm.oracle.strategies import workloads
from mini_vllm.sampling_params import SamplingParams

from phase05_helpers import rows, runner_side, written

CONFIG = {"block_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 32, "max_model_len": 32}


def make_runner(impl):
    side = runner_side(impl)(CONFIG, None, 64, 63)
    return side.runner


def new(req_id, prompt, blocks, computed=0, **params) -> NewRequestData:
    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(**params),
        block_ids=(list(blocks),),
        num_computed_tokens=computed,
    )


def step(new_reqs=(), cached=(), scheduled=None, finished=(), preempted=()) -> SchedulerOutput:
    """A SchedulerOutput; ``cached`` holds (req_id, num_computed_tokens, new
    blocks or None, resumed?[, num_output_tokens, default 0]) and
    ``scheduled`` {req_id: tokens} (default: 1 token for every request in
    new_reqs and cached)."""
    if scheduled is None:
        scheduled = {r.req_id: 1 for r in new_reqs} | {c[0]: 1 for c in cached}
    return SchedulerOutput(
        scheduled_new_reqs=list(new_reqs),
        scheduled_cached_reqs=CachedRequestData(
            req_ids=[c[0] for c in cached],
            resumed_req_ids={c[0] for c in cached if c[3]},
            new_token_ids=[[] for _ in cached],
            all_token_ids={},
            new_block_ids=[None if c[2] is None else (list(c[2]),) for c in cached],
            num_computed_tokens=[c[1] for c in cached],
            num_output_tokens=[c[4] if len(c) > 4 else 0 for c in cached],
        ),
        num_scheduled_tokens=dict(scheduled),
        total_num_scheduled_tokens=sum(scheduled.values()),
        num_common_prefix_blocks=[0],
        finished_req_ids=set(finished),
        preempted_req_ids=set(preempted),
    )


def apply(runner, out):
    written(runner._update_states, out)


def blocks_of(runner, req_id):
    batch = runner.input_batch
    row = batch.req_id_to_index[req_id]
    table = batch.block_table[0]
    return table.block_table.np[row, : int(table.num_blocks_per_row[row])].tolist()


# ------------------------------------------------------------ the rules


@pytest.mark.points(3)
def test_new_requests_join_whole_with_their_own_block_lists(impl):
    runner = make_runner(impl)
    reqs = [
        new("a", [1, 2, 3, 4, 5], [1, 2]),
        new("b", [6, 7], [3], temperature=0.0, seed=3),
        new("c", [8], [4], temperature=1.0, seed=5),
    ]
    apply(runner, step(reqs, scheduled={"a": 5, "b": 2, "c": 1}))
    assert sorted(runner.requests) == ["a", "b", "c"], (
        f"Every new request gets a CachedRequestState in runner.requests; got {runner.requests}."
    )
    assert runner.input_batch.req_ids == ["a", "b", "c"], (
        "New requests join the batch in the order they come: rows a, b, c; got "
        f"{runner.input_batch.req_ids}."
    )
    a = runner.requests["a"]
    assert (a.block_ids, a.num_computed_tokens, a.output_token_ids) == (([1, 2],), 0, []), (
        f"a's state: block_ids ([1, 2],), num_computed_tokens 0, no output tokens; got "
        f"{a.block_ids}, {a.num_computed_tokens}, {a.output_token_ids}."
    )
    reqs[0].block_ids[0].append(99)  # the scheduler's list, reused by it
    assert a.block_ids == ([1, 2],), (
        "The state must hold its OWN block id lists (copies): the runner extends them in "
        "later steps, and the SchedulerOutput's lists belong to the scheduler. Editing the "
        f"SchedulerOutput's list changed a's state to {a.block_ids}."
    )
    gens = {r: runner.requests[r].generator for r in "abc"}
    assert gens["a"] is None and gens["b"] is None, (
        "Only a RANDOM request with a seed gets its own generator (b is greedy: its seed is "
        f"ignored; a has none). Got {gens}."
    )
    assert gens["c"] is not None and gens["c"].initial_seed() == 5, (
        "c (temperature 1.0, seed 5) needs a torch.Generator seeded with 5 on the runner's "
        f"device, so its samples repeat; got {gens['c']}."
    )


@pytest.mark.points(3)
def test_a_running_request_gets_its_deltas_in_place(impl):
    runner = make_runner(impl)
    apply(runner, step([new("a", [1] * 6, [1]), new("b", [2] * 3, [5])]))
    apply(runner, step(cached=[("a", 4, [2], False), ("b", 3, None, False)]))
    a, b = runner.requests["a"], runner.requests["b"]
    assert (a.num_computed_tokens, b.num_computed_tokens) == (4, 3), (
        "A cached request's state takes the step's num_computed_tokens: expected a 4, b 3, "
        f"got a {a.num_computed_tokens}, b {b.num_computed_tokens}."
    )
    assert (a.block_ids, b.block_ids) == (([1, 2],), ([5],)), (
        "A running request's new blocks EXTEND its block ids (new_block_ids None: no new "
        f"blocks): expected a ([1, 2],), b ([5],); got a {a.block_ids}, b {b.block_ids}."
    )
    batch = runner.input_batch
    assert batch.req_ids == ["a", "b"], (
        f"Requests still in the batch keep their rows: expected [a, b], got {batch.req_ids}."
    )
    got = (int(batch.num_computed_tokens_cpu[0]), blocks_of(runner, "a"), blocks_of(runner, "b"))
    assert got == (4, [1, 2], [5]), (
        "Its row is edited in place: num_computed_tokens_cpu[row] = 4 and the new block "
        "appended to its block table row (batch.block_table.append_row). Expected (a's "
        f"computed, a's blocks, b's blocks) (4, [1, 2], [5]), got {got}."
    )


@pytest.mark.points(3)
def test_finished_requests_are_forgotten_unscheduled_ones_kept(impl):
    runner = make_runner(impl)
    apply(runner, step([new("a", [1], [1]), new("b", [2], [2]), new("c", [3], [3])]))
    apply(runner, step(cached=[("b", 1, None, False)], finished={"a"}, preempted={"c"}))
    assert "a" not in runner.requests, (
        "A finished request's state is dropped (runner.requests.pop): it will never come back."
    )
    assert "c" in runner.requests, (
        "A preempted (or simply unscheduled) request leaves the batch but KEEPS its state in "
        "runner.requests: when it is resumed, only deltas arrive, and its output tokens live "
        "in that state."
    )
    assert runner.input_batch.req_ids == ["b"], (
        "Only requests scheduled this step stay in the batch: a (finished) and c (not "
        "scheduled) leave, and condense moves b from row 1 down into row 0. Got "
        f"{runner.input_batch.req_ids}."
    )


@pytest.mark.points(3)
def test_a_resumed_request_gets_new_blocks_and_rejoins(impl):
    runner = make_runner(impl)
    apply(runner, step([new("a", [1, 2], [1]), new("c", [3, 4, 5], [3, 4])]))
    runner.requests["c"].output_token_ids.append(42)  # what _bookkeeping_sync would do
    apply(runner, step(cached=[("a", 2, None, False)], preempted={"c"}))
    apply(runner, step(cached=[("a", 3, None, False), ("c", 0, [7, 8], True, 1)]))
    c = runner.requests["c"]
    assert c.block_ids == ([7, 8],), (
        "A resumed request's blocks were freed when it was preempted: its new_block_ids "
        f"REPLACE its block ids. Expected ([7, 8],), got {c.block_ids} (extending would keep "
        "the freed [3, 4])."
    )
    assert c.num_computed_tokens == 0, f"c computed 0 tokens, not {c.num_computed_tokens}."
    assert "c" in runner.input_batch.req_id_to_index, (
        "A resumed request is not in the batch: it joins again with its whole state "
        "(reqs_to_add, then batch.add_request)."
    )
    got = [r for r in rows(runner.input_batch) if r and r[0] == "c"]
    assert got == [("c", [3, 4, 5, 42], [7, 8])], (
        "c's row after resuming: (id, prompt + its output tokens, its new blocks) = "
        f"('c', [3, 4, 5, 42], [7, 8]); got {got}."
    )


@pytest.mark.points(2)
def test_a_request_left_out_of_a_step_comes_back_with_its_blocks_extended(impl):
    runner = make_runner(impl)
    apply(runner, step([new("a", [1], [1]), new("b", [2], [5])]))
    apply(runner, step(cached=[("a", 1, None, False)]))  # b left out, not preempted
    assert runner.input_batch.req_ids == ["a"], (
        f"b was not scheduled this step: it leaves the batch; got {runner.input_batch.req_ids}."
    )
    apply(runner, step(cached=[("a", 2, None, False), ("b", 1, [6], False)]))
    b = runner.requests["b"]
    assert b.block_ids == ([5, 6],), (
        "b is back but NOT resumed (it kept its blocks): its new blocks extend its block ids; "
        f"expected ([5, 6],), got {b.block_ids}."
    )
    assert blocks_of(runner, "b") == [5, 6], (
        "b is not in the batch, so it joins again with its whole state: its row must hold "
        f"[5, 6]; got {blocks_of(runner, 'b')}."
    )


@pytest.mark.points(2)
def test_an_id_finished_and_new_in_one_step_is_a_new_request(impl):
    runner = make_runner(impl)
    apply(runner, step([new("a", [1, 1, 1], [1])]))
    runner.requests["a"].output_token_ids.append(9)
    apply(runner, step([new("a", [4, 4], [2])], finished={"a"}))
    a = runner.requests["a"]
    assert (a.prompt_token_ids, a.output_token_ids, a.block_ids) == ([4, 4], [], ([2],)), (
        "An aborted request resubmitted under the same id arrives finished AND new in one "
        "step: the finished one is dropped first, then the new one joins. Expected prompt "
        f"[4, 4], no outputs, blocks ([2],); got {a.prompt_token_ids}, {a.output_token_ids}, "
        f"{a.block_ids}."
    )
    assert runner.input_batch.req_ids == ["a"], (
        f"a must be in the batch once: {runner.input_batch.req_ids}."
    )


# ------------------------------------------------------------ upstream's scheduler


def _check(impl, workload, threshold=None):
    expected = run_runner_workload(workload, UpstreamRunnerSide, threshold)
    try:
        got = written(run_runner_workload, workload, runner_side(impl), threshold)
    except Exception as e:  # noqa: BLE001 - report it with the workload that raised it
        pytest.fail(
            f"Workload {workload.name!r}: your runner raised {type(e).__name__}: {e} on "
            f"SchedulerOutputs upstream's replay applies cleanly.\nworkload: {workload.to_dict()}",
            pytrace=False,
        )
    diff = first_runner_difference(expected, got, labels=("upstream", "yours"))
    assert diff is None, (
        f"Workload {workload.name!r}: your runner and upstream's part ways {diff}\nThe rules: "
        "finished requests leave and are forgotten; unscheduled ones leave and keep their "
        "state; new ones join whole; running ones in the batch are edited in place (computed "
        "count, append_row); resumed ones replace their blocks and join again; anyone else "
        f"coming back extends its blocks and joins again.\nworkload: {workload.to_dict()}"
    )


@pytest.mark.upstream
@pytest.mark.points(1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("workload", SCENARIOS, ids=[w.name for w in SCENARIOS])
def test_upstream_schedulers_outputs_on_named_scenarios(impl, workload):
    _check(impl, workload)


@pytest.mark.upstream
@pytest.mark.points(5)
@pytest.mark.timeout(120)
@lab_settings(20)
@given(workload=workloads())
def test_upstream_schedulers_outputs_on_generated_workloads(impl, workload):
    _check(impl, workload)
