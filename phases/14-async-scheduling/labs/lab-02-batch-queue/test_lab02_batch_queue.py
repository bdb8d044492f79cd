"""Lab 14.2 — the batch queue: two steps in flight.

Graded: the ``LAB 14.2`` region of ``labs/phase_14/core.py``,
``EngineCore.step_with_batch_queue`` (upstream's,
vllm/v1/engine/core.py:469). Every other region, your Lab 14.1 among them,
holds the reference's code while this lab is graded.

First your engine core with a recording worker and model (no weights): the
order of the schedule / submit / result / update_from_output calls, never
more than two steps in flight, outputs taken oldest first, an empty schedule
or a finished step taken in at once. Then a tiny random Qwen3 run with async
scheduling on (your batch queue) and off (the reference's ``step``): the same
greedy tokens, including stops that land on a step already scheduled, and
with preemption.

Every engine loop here runs on a watchdog thread: a queue that waits on a
step never submitted, or never empties, fails its test by name instead of
hanging the run.
"""

from __future__ import annotations

import pytest
from phase14_helpers import async_scheduler, recording_core, within

import mini_vllm.testing as mini
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.sampling_params import SamplingParams

SMALL = dict(block_size=4, num_blocks=40, max_num_batched_tokens=64, max_model_len=32)


def token(request) -> int:
    """The fake model: request "x"'s output i is 100 * (index of x) + i."""
    return 100 * "abcd".index(request.request_id) + request.num_output_tokens


def core_with(impl, prompts: dict[str, list[int]], done=False, **params):
    sched = async_scheduler(impl.async_scheduler.AsyncScheduler, **SMALL)
    for req in mini.create_requests(
        len(prompts),
        req_ids=list(prompts),
        prompt_token_ids=list(prompts.values()),
        block_size=4,
        **params,
    ):
        sched.add_request(req)
    return recording_core(impl.core.EngineCore, sched, token, done)


def step(core, seconds=20):
    """One step_with_batch_queue: (what it logged, {req_id: new tokens})."""
    before = len(core.log)
    out = within(seconds, core.step_with_batch_queue, "step_with_batch_queue")
    return core.log[before:], {o.request_id: o.new_token_ids for o in out.outputs}


def run_to_end(core, max_steps=200):
    """Steps until nothing is left or in flight: {req_id: every token}."""
    tokens: dict[str, list[int]] = {}

    def loop():
        for _ in range(max_steps):
            if not core.scheduler.has_requests() and not core.batch_queue:
                return
            for o in core.step_with_batch_queue().outputs:
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        raise AssertionError(
            f"still not done after {max_steps} steps: log tail {core.log[-8:]}, "
            f"{len(core.batch_queue)} step(s) in the queue"
        )

    within(60, loop, "an engine loop of step_with_batch_queue")
    return tokens


# ------------------------------------------------------------------ the order of calls


@pytest.mark.points(6)
def test_fill_the_queue_before_taking_outputs(impl):
    core = core_with(impl, {"a": [1, 2, 3, 4, 5]}, max_tokens=4)
    log, out = step(core)
    assert log == [("schedule", 1), ("submit", 1)] and out == {}, (
        f"Step 1 with one step (which runs tokens) in flight and room for two: schedule, "
        f"submit to the worker and return empty outputs without waiting. Got calls {log}, "
        f"outputs {out}."
    )
    assert len(core.batch_queue) == 1, f"the queue should hold step 1, holds {core.batch_queue}"
    log, out = step(core)
    want = [("schedule", 2), ("submit", 2), ("result", 1), ("update", 1)]
    assert log == want and out == {"a": [0]}, (
        f"Step 2: schedule and submit step 2 (the queue is now full), then wait for the "
        f"OLDEST step (1) and take its output in. Want calls {want} and outputs {{'a': [0]}}; "
        f"got {log} and {out}."
    )
    log, out = step(core)
    want = [("schedule", 3), ("submit", 3), ("result", 2), ("update", 2)]
    assert log == want and out == {"a": [1]}, f"Step 3: want {want}, got {log} (outputs {out})"
    assert (core.num_steps, core.num_scheduled_tokens) == (3, 7), (
        f"num_steps and num_scheduled_tokens after 3 steps (5 prompt tokens, then 1 and 1): "
        f"want (3, 7), got {(core.num_steps, core.num_scheduled_tokens)}: count every step "
        "as step() does."
    )


@pytest.mark.points(7)
def test_a_whole_run_oldest_first_never_more_than_two_in_flight(impl):
    prompts = {"a": [1, 2, 3, 4, 5], "b": [7] * 9, "c": [3, 1], "d": [8, 8, 8]}
    core = core_with(impl, prompts, max_tokens=6, stop_token_ids=[302])
    tokens = run_to_end(core)
    want = {r: [100 * "abcd".index(r) + i for i in range(6)] for r in prompts}
    want["d"] = [300, 301, 302]  # d's third token is a stop token: step 4 was already scheduled
    assert tokens == want, (
        f"The tokens each request got: {tokens}; want {want} (the fake model gives request "
        "x's output i = 100 * index(x) + i; c... is stopped by its stop token 302)."
    )
    results = [n for what, n in core.log if what == "result"]
    updates = [n for what, n in core.log if what == "update"]
    submitted = [n for what, n in core.log if what == "submit"]
    assert results == submitted == updates, (
        f"Steps submitted {submitted}, results taken {results}, updates {updates}: every step "
        "must be taken in, oldest first (pop the right end; appendleft the new one), and its "
        "output goes to update_from_output with its own scheduler output."
    )
    assert core.worker.most_in_flight <= 2, (
        f"{core.worker.most_in_flight} steps were in flight at once: at most two (take the "
        "oldest in once the queue is full)."
    )
    schedules = sum(what == "schedule" for what, _ in core.log)
    assert core.num_steps == schedules, f"num_steps {core.num_steps}, schedule() calls {schedules}"


@pytest.mark.points(5)
def test_an_empty_schedule_or_a_finished_step_is_taken_in_at_once(impl):
    core = core_with(impl, {"a": [1, 2, 3]}, max_tokens=1)
    step(core)
    log, out = step(core)
    want = [("schedule", 2), ("submit", 2), ("result", 1), ("update", 1)]
    assert log == want and out == {"a": [0]}, (
        f"max_tokens=1: step 2's schedule runs no token (a's only token is in flight). A step "
        f"that runs nothing must not leave the oldest output waiting: want {want}, got {log}."
    )
    rest = []
    for _ in range(6):
        rest += step(core)[0]
    assert ("result", 2) in rest and not core.batch_queue, (
        f"after a finished, every step in flight must still be taken in: calls {rest}, "
        f"queue {list(core.batch_queue)}"
    )
    log, out = step(core)
    assert log == [] and out == {}, (
        f"Nothing waiting, running or in flight: return empty outputs without calling "
        f"schedule() or waiting on anything; got calls {log}."
    )

    aborted = core_with(impl, {"a": [1, 2, 3]}, max_tokens=3)
    aborted.abort_requests(["a"])
    log, _ = step(aborted)
    want = [("schedule", 1), ("submit", 1), ("result", 1), ("update", 1)]
    assert log == want, (
        f"a was aborted before any step: step 1's schedule runs nothing (it only tells the "
        f"worker that a finished). A step that runs no token is submitted and taken in at "
        f"once, even with room in the queue: want {want}, got {log}."
    )

    done = core_with(impl, {"a": [1, 2, 3]}, done=True, max_tokens=3)
    log, out = step(done)
    want = [("schedule", 1), ("submit", 1), ("result", 1), ("update", 1)]
    assert log == want and out == {"a": [0]}, (
        f"When the oldest step is already done (future.done()), take its output in now rather "
        f"than return empty: want {want}, got {log}."
    )


# ------------------------------------------------------------------ a real (tiny) model

PROMPTS = [[5 + i, 17, 23 + i, 4, 9, 11 + 2 * i] for i in range(4)]


def generate(llm, params, seconds=30):
    outs = within(
        seconds,
        lambda: llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False),
        "LLM.generate with your batch queue",
    )
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


def llms(impl, folder, **kwargs):
    """(the reference's synchronous LLM, an async one with your batch queue)."""
    sync = LLM(folder, **kwargs)
    mine = LLM(folder, async_scheduling=True, **kwargs)
    # LLM builds the reference EngineCore; yours subclasses it and re-opens
    # only step_with_batch_queue.
    mine.llm_engine.engine_core.__class__ = impl.core.EngineCore
    return sync, mine


@pytest.mark.points(7)
@pytest.mark.timeout(240)
def test_tiny_model_same_tokens_with_stops_on_scheduled_steps(impl, tiny_qwen3_folder):
    sync, mine = llms(impl, tiny_qwen3_folder, max_model_len=64, kv_cache_memory_bytes=8 << 20)
    free = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (1, 2, 9, 14)]
    base = generate(sync, free)
    got = generate(mine, free)
    assert got == base, (
        f"max_tokens 1, 2, 9, 14, greedy: async scheduling with your batch queue gave {got}, "
        f"the synchronous engine {base}."
    )
    stops = [
        SamplingParams(max_tokens=14, temperature=0, stop_token_ids=[t[0][k]])
        for t, k in zip(base, (0, 1, 3, 6), strict=True)
    ]
    expected = generate(sync, stops)
    assert all(reason == "stop" for _, reason in expected), expected
    got = generate(mine, stops)
    assert got == expected, (
        f"Each request stops on a token of its own (the 1st, 2nd, 4th, 7th it makes), while its "
        f"next step is already scheduled: got {got}, want {expected}."
    )
    core = mine.llm_engine.engine_core
    free_blocks = core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    assert free_blocks == core.vllm_config.cache_config.num_gpu_blocks - 1, (
        f"{free_blocks} KV blocks free after the run: every block should be back in the pool."
    )


@pytest.mark.points(5)
@pytest.mark.timeout(240)
def test_tiny_model_same_tokens_under_preemption(impl, tiny_qwen3_folder):
    kwargs = dict(max_model_len=24, num_gpu_blocks_override=9, block_size=4, max_num_seqs=4)
    sync, mine = llms(impl, tiny_qwen3_folder, **kwargs)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    expected = generate(sync, params)
    got = generate(mine, params)
    assert sync.llm_engine.get_stats()["num_preemptions"] > 0
    assert got == expected, (
        f"Four requests in a KV cache too small for all of them (preemption with steps in "
        f"flight): your batch queue gave {got}, the synchronous engine {expected}."
    )
