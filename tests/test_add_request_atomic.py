"""``LLMEngine.add_request`` adds all of a request or nothing (issue 29, item 12).

Two kinds of failure are checked on the tiny seeded Qwen3, under both
scheduling policies:
- bad values for the fields add_request takes beside the prompt and the
  sampling parameters (``request_id``, ``priority``, ``arrival_time``) are
  refused in one line naming the field; upstream's types say str, int and
  float (vllm/v1/engine/llm_engine.py:209-219). A string priority used to
  reach the priority queue's heap, half-add the next request, and make every
  later add_request and step raise;
- a failure injected at each stage a request passes through (the output
  processor, before and after it keeps the request's state; the scheduler,
  before it changes anything, after it queued the request, after it
  finished; Ctrl-C in the middle) reaches the caller.
The same for ``AsyncLLM.add_request``, whose n children are added one by
one: a failure at the second leaves none. After each, nothing of the request
is left in the scheduler, its queues or the output processor, and the engine
serves the next request with the same tokens as a fresh engine.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest

from mini_vllm.engine.async_llm import AsyncLLM
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = {"prompt_token_ids": list(range(3, 40))}  # two full blocks and a bit


def make_llm(path: str, policy: str) -> LLM:
    return LLM(path, max_model_len=128, kv_cache_memory_bytes=8 << 20, policy=policy)


@pytest.fixture(scope="module")
def fresh_tokens(tiny_qwen3) -> list[int]:
    (out,) = make_llm(tiny_qwen3[0], "fcfs").generate(PROMPT, GREEDY, use_tqdm=False)
    return out.outputs[0].token_ids


@pytest.fixture(scope="module", params=["fcfs", "priority"])
def llm(request, tiny_qwen3) -> LLM:
    return make_llm(tiny_qwen3[0], request.param)


def run_to_end(engine, request_id: str) -> list[int]:
    tokens = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                tokens = out.outputs[0].token_ids
    return tokens


def assert_nothing_left_and_serving(llm: LLM, fresh_tokens: list[int]) -> None:
    engine = llm.llm_engine
    scheduler = engine.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    assert not scheduler.requests, f"left in the scheduler: {list(scheduler.requests)}"
    assert len(scheduler.waiting) == 0 and len(scheduler.skipped_waiting) == 0
    assert not scheduler.running
    assert not engine.output_processor.request_states
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    engine.add_request("next", PROMPT, GREEDY, priority=0)
    assert run_to_end(engine, "next") == fresh_tokens
    assert not scheduler.requests and not engine.output_processor.request_states


BAD_FIELDS = [
    ({"priority": "high"}, ValueError, "priority must be an integer, got str 'high'"),
    ({"priority": 1.5}, ValueError, "priority must be an integer, got float 1.5"),
    ({"priority": True}, ValueError, "priority must be an integer, got bool True"),
    ({"priority": None}, ValueError, "priority must be an integer, got NoneType"),
    ({"arrival_time": "now"}, ValueError, "arrival_time must be a finite number or None, got str"),
    ({"arrival_time": float("nan")}, ValueError, "arrival_time must be a finite number or None"),
    ({"request_id": 5}, TypeError, "request_id must be a string, got int"),
]


@pytest.mark.parametrize(
    ("fields", "error", "message"), BAD_FIELDS, ids=[repr(f) for f, _, _ in BAD_FIELDS]
)
def test_a_bad_field_is_refused_and_the_next_request_runs(
    llm, fresh_tokens, fields, error, message
):
    engine = llm.llm_engine
    kwargs = {"request_id": "bad", "prompt": PROMPT, "params": GREEDY, **fields}
    with pytest.raises(error, match=message):
        engine.add_request(**kwargs)
    # The report's sequence: then a request at priority 0 and a step.
    engine.add_request("second", {"prompt_token_ids": [5, 6, 7]}, GREEDY, priority=0)
    run_to_end(engine, "second")
    assert_nothing_left_and_serving(llm, fresh_tokens)


def raise_before(error):
    def wrap(original):
        def failing(*args, **kwargs):
            raise error

        return failing

    return wrap


def raise_after(error):
    def wrap(original):
        def failing(*args, **kwargs):
            original(*args, **kwargs)
            raise error

        return failing

    return wrap


# (where, which method of it, how it fails)
STAGES = {
    "output processor, before it keeps the state": (
        "output_processor",
        "add_request",
        raise_before(RuntimeError("injected")),
    ),
    "output processor, after it kept the state": (
        "output_processor",
        "add_request",
        raise_after(RuntimeError("injected")),
    ),
    "scheduler, before it changes anything": (
        "scheduler",
        "add_request",
        raise_before(RuntimeError("injected")),
    ),
    "waiting queue, after the push": (
        "waiting",
        "add_request",
        raise_after(RuntimeError("injected")),
    ),
    "waiting queue, Ctrl-C after the push": (
        "waiting",
        "add_request",
        raise_after(KeyboardInterrupt()),
    ),
    "scheduler, after it finished": (
        "scheduler",
        "add_request",
        raise_after(RuntimeError("injected")),
    ),
}


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_failure_at_any_stage_leaves_nothing_behind(llm, fresh_tokens, monkeypatch, stage):
    engine = llm.llm_engine
    scheduler = engine.engine_core.scheduler
    where, method, wrap = STAGES[stage]
    owner = {
        "output_processor": engine.output_processor,
        "scheduler": scheduler,
        "waiting": scheduler.waiting,
    }[where]
    monkeypatch.setattr(owner, method, wrap(getattr(owner, method)))
    with pytest.raises((RuntimeError, KeyboardInterrupt)):
        engine.add_request("doomed", PROMPT, GREEDY)
    monkeypatch.undo()
    assert_nothing_left_and_serving(llm, fresh_tokens)


def test_async_llm_adds_all_children_or_none(tiny_qwen3, fresh_tokens, monkeypatch):
    engine = AsyncLLM.from_model(tiny_qwen3[0], max_model_len=128, kv_cache_memory_bytes=8 << 20)
    output_processor = engine.output_processor
    add = output_processor.add_request
    calls = itertools.count()

    def second_child_fails(*args, **kwargs):
        if next(calls) == 1:
            raise RuntimeError("injected")
        add(*args, **kwargs)

    async def run() -> list[int]:
        monkeypatch.setattr(output_processor, "add_request", second_child_fails)
        with pytest.raises(RuntimeError, match="injected"):
            async for _ in engine.generate(PROMPT, GREEDY, "doomed", n=2):
                pass
        monkeypatch.undo()
        assert not output_processor.request_states
        assert not engine.collectors
        async for out in engine.generate(PROMPT, GREEDY, "next"):
            final = out
        return final.outputs[0].token_ids

    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(run()) == fresh_tokens
    finally:
        engine.shutdown()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()
