"""Lab 02 (01.2) — one engine step, by hand.

Graded: the ``LAB 01.2`` regions of ``labs/phase_01/core.py``
(``EngineCore.step``: schedule -> execute_model -> update_from_output, and
the empty case) and of ``labs/phase_01/llm_engine.py`` (``LLMEngine.step``:
EngineCore's outputs -> the output processor -> RequestOutputs, then abort
in EngineCore what the front end finished on a stop string). Every other
region holds the reference's code while this lab is graded.

Oracles: HF transformers' greedy tokens on the same weights, and the
reference engine run on the same workload in this session.
"""

from __future__ import annotations

import pytest

from mini_vllm.engine import EngineCoreOutputs
from mini_vllm.oracle import lifecycle
from mini_vllm.oracle.workload import Progress
from mini_vllm.sampling_params import SamplingParams


def built(impl, loaded, monkeypatch, **config):
    return lifecycle.student_engine(impl, loaded, monkeypatch, **config)


@pytest.mark.points(2)
@pytest.mark.timeout(120)
def test_empty_engine_step_does_not_schedule(impl, loaded, monkeypatch):
    """With no request at all, EngineCore.step returns empty outputs and
    neither schedules nor counts a step (upstream vllm/v1/engine/core.py:437)."""
    engine = built(impl, loaded, monkeypatch)
    core = engine.engine_core
    calls = []
    real = core.scheduler.schedule
    core.scheduler.schedule = lambda: calls.append(1) or real()
    try:
        out = core.step()
    except NotImplementedError as e:
        pytest.fail(f"{e}: a lab region is not written yet.", pytrace=False)
    assert isinstance(out, EngineCoreOutputs) and not out.outputs, (
        f"EngineCore.step() with no requests returned {out!r}: it must return an empty "
        "EngineCoreOutputs() (scheduler.has_requests() is False)."
    )
    assert not calls, (
        "EngineCore.step() called schedule() with no requests: check "
        "self.scheduler.has_requests() first and return EngineCoreOutputs()."
    )
    assert core.num_steps == 0, f"an empty step must not be counted; num_steps = {core.num_steps}"
    assert engine.step() == [], "LLMEngine.step() with nothing to do must return []"


@pytest.mark.points(3)
@pytest.mark.timeout(300)
def test_greedy_tokens_equal_transformers(impl, student_run, hf_greedy_tokens, workload):
    """The two requests that run to max_tokens (one of them preempted and
    resumed) produce exactly HF transformers' greedy tokens."""
    records, _ = student_run()
    tokens: dict[str, list[int]] = {}
    for rec in records[1:]:
        for rid, new in rec.new_token_ids.items():
            tokens.setdefault(rid, []).extend(new)
    for rid in ("length", "preempted"):
        want = hf_greedy_tokens[rid]
        assert tokens.get(rid) == want, (
            f"request {rid!r} ({workload.prompts[rid]!r}): transformers' greedy tokens are "
            f"{want}, your engine's EngineCore outputs carried {tokens.get(rid)}. Every sampled "
            "token must reach the output exactly once: step() returns what "
            "update_from_output() returns."
        )


@pytest.mark.points(3)
@pytest.mark.timeout(300)
def test_steps_and_outputs_equal_the_reference(impl, reference_run, student_run):
    """Step for step, your engine schedules, samples, finishes and reports
    what the reference engine does, and counts the same steps."""
    expected, ref_stats = reference_run
    got, stats = student_run()
    diff = lifecycle.first_difference(expected, got)
    assert diff is None, f"your engine's run differs from the reference's: {diff}"
    for key in (
        "num_steps",
        "num_preemptions",
        "num_scheduled_tokens",
        "prefix_cache_queries",
        "prefix_cache_hits",
    ):
        assert stats[key] == ref_stats[key], (
            f"get_stats()[{key!r}]: the reference counts {ref_stats[key]}, yours {stats[key]}. "
            "EngineCore.step counts num_steps, num_preemptions and num_scheduled_tokens for each "
            "scheduled step; LLMEngine.step passes the scheduler stats to record_stats()."
        )


@pytest.mark.points(3)
@pytest.mark.timeout(300)
def test_stop_string_request_is_aborted_in_core(impl, student_run, workload):
    """The request the front end finished on a stop string is aborted in
    EngineCore in the same step: its Request is FINISHED_ABORTED, it is never
    scheduled again, and its KV blocks go back to the pool."""
    records, _ = student_run()
    rid = "stop_string"
    stop = workload.params[rid].stop[0]
    ends = [rec for rec in records if rec.finish_reason.get(rid) is not None]
    assert ends, f"request {rid!r} (stop={stop!r}) never finished in a RequestOutput"
    end = ends[0]
    assert (end.finish_reason[rid], end.stop_reason[rid]) == ("stop", stop), (
        f"request {rid!r} finished with {end.finish_reason[rid]!r}/{end.stop_reason[rid]!r}, "
        f"expected 'stop'/{stop!r}."
    )
    assert end.statuses[rid] == "FINISHED_ABORTED", (
        f"step {end.step}: the front end finished {rid!r} on stop string {stop!r}, but its "
        f"Request is still {end.statuses[rid]} in EngineCore. LLMEngine.step must call "
        "engine_core.abort_requests(processed.reqs_to_abort) "
        "(upstream vllm/v1/engine/llm_engine.py:309)."
    )
    later = [rec.step for rec in records if rec.step > end.step and rid in rec.scheduled]
    assert not later, f"{rid!r} finished at step {end.step} but was scheduled again at {later}"
    assert records[-1].free_blocks == records[0].free_blocks, (
        f"after the run, {records[-1].free_blocks} blocks are free, {records[0].free_blocks} were "
        "free before: some request's blocks were never freed."
    )


def abort_scenario(engine):
    """Two requests; 'drop' is aborted by the user after step 1. Returns
    ({request id: [(token ids, finish_reason) of each RequestOutput]}, steps)."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("keep", "Hello there", params)
    engine.add_request("drop", "General Kenobi", params)
    seen: dict[str, list] = {"keep": [], "drop": []}
    step = 0
    progress = Progress()
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append((out.outputs[0].token_ids, out.outputs[0].finish_reason))
        step += 1
        progress.after_step(engine.engine_core.scheduler, step)
        if step == 1:
            engine.abort_request("drop")
    return seen, engine.engine_core.num_steps


@pytest.mark.points(2)
@pytest.mark.timeout(120)
def test_user_abort_between_steps(impl, loaded, monkeypatch):
    """A request aborted between steps produces no further output, and the
    other request runs to its end: nothing lost, nothing extra (the
    reference engine on the same two requests is the oracle)."""
    want, want_steps = abort_scenario(lifecycle.make_engine(loaded))
    try:
        got, got_steps = abort_scenario(built(impl, loaded, monkeypatch))
    except NotImplementedError as e:
        pytest.fail(f"{e}: a lab region is not written yet.", pytrace=False)
    assert len(want["drop"]) == 1, f"the scenario lost its point: the reference gave {want['drop']}"
    assert len(got["drop"]) == 1, (
        f"'drop' was aborted by the user after step 1 and must get no RequestOutput after "
        f"that; your engine gave {len(got['drop'])} in all: {got['drop']}."
    )
    assert got == want, (
        f"RequestOutputs (token ids, finish_reason) differ from the reference's: expected "
        f"{want}, got {got}."
    )
    assert got_steps == want_steps, (
        f"the reference counts {want_steps} engine steps for this, yours {got_steps}: count a "
        "step only when one is scheduled."
    )


def two_preemptions_run(engine):
    """Three 4-token prompts on three usable 4-token blocks: at step 2 all
    three need a second block, so the scheduler preempts two requests in that
    one step. Returns (the preempted ids of each step, num_preemptions)."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i, ids in enumerate([[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]]):
        engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params)
    sched = engine.engine_core.scheduler
    real_schedule = sched.schedule
    preempted = []

    def schedule():
        out = real_schedule()
        preempted.append(sorted(out.preempted_req_ids or ()))
        return out

    sched.schedule = schedule
    progress = Progress()
    while engine.has_unfinished_requests():
        engine.step()
        progress.after_step(sched, len(preempted))
    return preempted, engine.engine_core.num_preemptions


@pytest.mark.points(2)
@pytest.mark.timeout(60)
def test_preemptions_are_counted_per_request(impl, loaded, monkeypatch):
    """A step that preempts two requests adds 2 to num_preemptions, not 1:
    EngineCore.step counts the requests in SchedulerOutput.preempted_req_ids."""
    config = dict(num_gpu_blocks=4, block_size=4, max_model_len=8)
    want_steps, want = two_preemptions_run(lifecycle.make_engine(loaded, **config))
    assert [len(p) for p in want_steps if p] == [2], (
        f"the scenario lost its point: the reference preempted {want_steps}"
    )
    two = next(p for p in want_steps if p)
    try:
        got_steps, got = two_preemptions_run(built(impl, loaded, monkeypatch, **config))
    except NotImplementedError as e:
        pytest.fail(f"{e}: a lab region is not written yet.", pytrace=False)
    assert got == want, (
        f"one step preempted two requests, {two} (your engine's preempted ids per step: "
        f"{got_steps}); num_preemptions should then be {want}, yours is {got}. "
        "Count every request in scheduler_output.preempted_req_ids, not the steps that "
        "preempted something."
    )
