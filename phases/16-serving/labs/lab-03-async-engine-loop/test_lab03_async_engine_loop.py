"""Lab 03 (16.3) — the async engine loop: one queue per request, abort on disconnect.

Graded: the ``LAB 16.3`` regions of ``labs/phase_16/async_llm.py``:
``RequestOutputCollector.get``, the routing of each output to its collector in
``AsyncLLM._process_outputs``, the abort in ``AsyncLLM.generate`` when its
caller goes away, and ``AsyncLLM.abort``. Every other region holds the
reference's code while this lab is graded.

Your ``AsyncLLM`` (and your collector, put in the reference module's place)
serves a real server on the loopback interface (``ServerThread``), over the
tiny seeded Llama, and the official ``openai`` client talks to it. Every
expected text comes from ``LLM.generate`` on the same model offline; a client
that goes away must leave every KV block free.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

import mini_vllm.engine.async_llm as reference_async_llm
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.entrypoints.openai.api_server import ServerThread
from mini_vllm.sampling_params import SamplingParams

from phase16_helpers import (
    ENGINE_ARGS,
    MODEL,
    all_blocks_free,
    num_free_blocks,
    wait_until_idle,
)

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]


@pytest.fixture
def served(impl, tiny_model, monkeypatch):
    """A server over your AsyncLLM (your collector class in the reference's place)."""
    monkeypatch.setattr(
        reference_async_llm, "RequestOutputCollector", impl.async_llm.RequestOutputCollector
    )
    engine = impl.async_llm.AsyncLLM(LLM(tiny_model, **ENGINE_ARGS).llm_engine, MODEL)
    server = ServerThread(engine, tiny_model, MODEL)
    yield server
    server.stop()


@pytest.fixture
def client(served):
    """The official client, pointed at your server."""
    with openai.OpenAI(
        base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=15.0
    ) as client:
        yield client


def reference_text(llm: LLM, prompt: str, **params) -> str:
    return llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0].outputs[0].text


def request(fn, *args, **kwargs):
    """Call the server (a stream is read to its end); an error from an unwritten
    region fails the test, saying so."""
    try:
        result = fn(*args, **kwargs)
        return list(result) if kwargs.get("stream") else result
    except openai.APITimeoutError:
        pytest.fail(
            "the server never answered: no output reached the request's collector, or get() "
            "never returned it (route each output to self.collectors[request_id]; get() "
            "waits on the event only while nothing is pending).",
            pytrace=False,
        )
    except openai.APIError as e:
        if "Lab 16.3" in str(e):
            pytest.fail(f"{e.message}: a lab region is not written yet.", pytrace=False)
        raise


def slow_steps(engine, monkeypatch, seconds: float = 0.03) -> list:
    """Make each engine step take ``seconds`` longer; returns the list of steps run."""
    runner = engine.llm_engine.engine_core.model_runner
    real_execute = runner.execute_model
    steps = []

    def slow_execute(scheduler_output, *args):
        steps.append(1)
        time.sleep(seconds)
        return real_execute(scheduler_output, *args)

    monkeypatch.setattr(runner, "execute_model", slow_execute)
    return steps


def held_after_disconnect(server) -> str | None:
    """None if the engine went idle with every block free, else what it still holds."""
    held = wait_until_idle(server.engine)
    if held:
        return (
            f"the client went away but the engine core still runs {held}: closing the "
            "generator (GeneratorExit) or cancelling its task (CancelledError) must abort every "
            "child of the request (AsyncLLM.abort sends the ids the output processor still knew "
            "to self.engine_core.abort_requests)"
        )
    if not all_blocks_free(server.engine):
        return (
            f"the engine core is idle but only {num_free_blocks(server.engine)} of "
            f"{server.engine.vllm_config.cache_config.num_gpu_blocks - 1} KV blocks are free"
        )
    return None


# ------------------------------------------------------------- the collector


@pytest.mark.points(3)
@pytest.mark.timeout(60)
def test_the_collector_hands_over_the_newest_output_of_each_child(impl, loop):
    collector = impl.async_llm.RequestOutputCollector("r", ["0_r", "1_r"])

    async def scenario():
        collector.put(0, "child 0, step 1")
        collector.put(1, "child 1, step 1")
        collector.put(0, "child 0, step 2")
        first = await asyncio.wait_for(collector.get(), 5)
        try:
            await asyncio.wait_for(collector.get(), 0.2)
            waited = False
        except TimeoutError:
            waited = True
        loop.call_later(0.05, collector.put, 1, "child 1, step 2")
        second = await asyncio.wait_for(collector.get(), 5)
        collector.put_error(RuntimeError("the step failed"))
        try:
            await asyncio.wait_for(collector.get(), 5)
            raised = None
        except RuntimeError as e:
            raised = e
        return first, waited, second, raised

    try:
        first, waited, second, raised = loop.run_until_complete(scenario())
    except NotImplementedError as e:
        pytest.fail(f"{e}: a lab region is not written yet.", pytrace=False)
    except TimeoutError:
        pytest.fail(
            "get() did not return within 5 s with outputs pending: wait on self.ready only "
            "while nothing is pending and no error is set",
            pytrace=False,
        )
    assert first == [(0, "child 0, step 2"), (1, "child 1, step 1")], (
        "after put(0, a), put(1, b), put(0, c), get() returns the newest output of each child "
        f"that moved, by child index: [(0, c), (1, b)]; yours returned {first}"
    )
    assert waited, (
        "a second get() with nothing new must wait (empty self.pending and clear self.ready "
        "when handing over); yours returned at once"
    )
    assert second == [(1, "child 1, step 2")], (
        f"a put while get() waits wakes it with just that output; yours returned {second}"
    )
    assert isinstance(raised, RuntimeError), "after put_error, get() raises that error"


# ---------------------------------------------------------- through a server


@pytest.mark.points(3)
@pytest.mark.timeout(120)
def test_whole_completions_equal_llm_generate(client, offline_llm):
    for prompt in PROMPTS:
        got = request(
            client.completions.create, model=MODEL, prompt=prompt, temperature=0, max_tokens=10
        )
        want = reference_text(offline_llm, prompt, temperature=0, max_tokens=10)
        assert got.choices[0].text == want, (
            f"prompt {prompt!r}: LLM.generate gives {want!r}, your server {got.choices[0].text!r}"
        )
    got = request(
        client.completions.create,
        model=MODEL,
        prompt=PROMPTS[0],
        n=2,
        temperature=0.9,
        seed=5,
        max_tokens=8,
    )
    want = [
        reference_text(offline_llm, PROMPTS[0], temperature=0.9, seed=5 + i, max_tokens=8)
        for i in range(2)
    ]
    assert [c.text for c in got.choices] == want, (
        f"n=2: child i runs with seed + i, each routed to its own index of the one collector "
        f"(self.collectors[child id] = (collector, index)); expected {want}, yours "
        f"{[c.text for c in got.choices]}"
    )


@pytest.mark.points(3)
@pytest.mark.timeout(120)
def test_streamed_deltas_concatenate_to_llm_generates_text(served, client, offline_llm):
    want = reference_text(offline_llm, PROMPTS[1], temperature=0, max_tokens=16)
    chunks = list(
        request(
            client.completions.create,
            model=MODEL,
            prompt=PROMPTS[1],
            temperature=0,
            max_tokens=16,
            stream=True,
        )
    )
    got = "".join(c.choices[0].text for c in chunks)
    assert got == want and len(chunks) > 1, (
        f"the streamed deltas must join to LLM.generate's text {want!r} (yours: {got!r} in "
        f"{len(chunks)} chunks): each step's output reaches the collector, get() hands over "
        "everything pending"
    )
    texts = ["", ""]
    for chunk in request(
        client.completions.create,
        model=MODEL,
        prompt=PROMPTS[2],
        n=2,
        temperature=0.9,
        seed=9,
        max_tokens=8,
        stream=True,
    ):
        texts[chunk.choices[0].index] += chunk.choices[0].text
    want = [
        reference_text(offline_llm, PROMPTS[2], temperature=0.9, seed=9 + i, max_tokens=8)
        for i in range(2)
    ]
    assert texts == want, f"n=2 streamed: expected {want}, yours {texts}"
    held = wait_until_idle(served.engine)
    assert not held and not served.engine.collectors, (
        f"after every request finished, the engine core holds {held} and "
        f"self.collectors {list(served.engine.collectors)}: a finished child's entry is removed"
    )


@pytest.mark.points(2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [1, 2])
def test_a_client_that_disconnects_mid_stream_frees_every_block(served, monkeypatch, n):
    """With n=2 the request has two children, and the disconnect must abort both."""
    steps = slow_steps(served.engine, monkeypatch)
    body = {
        "model": MODEL,
        "prompt": PROMPTS[1],
        "max_tokens": 100,
        "ignore_eos": True,
        "stream": True,
        "n": n,
        "temperature": 0.8,
    }
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        payload = json.loads(first[len("data: ") :])
        if "error" in payload:
            pytest.fail(f"{payload['error']['message']}", pytrace=False)
        assert served.engine.llm_engine.engine_core.scheduler.requests, "still generating"
    # The connection is closed here: the server closes the stream's generators.
    problem = held_after_disconnect(served)
    assert problem is None, problem
    assert len(steps) < 100, f"the request ran all {len(steps)} steps: it was never aborted"
    assert not served.engine.collectors, (
        f"self.collectors still holds {list(served.engine.collectors)} after the abort"
    )
    assert not served.engine.output_processor.request_states, (
        "the output processor still tracks the aborted request"
    )


@pytest.mark.points(3)
@pytest.mark.timeout(120)
def test_a_client_that_leaves_before_a_whole_answer_frees_every_block(served, monkeypatch):
    """Not streamed: the handler's task is cancelled (CancelledError in generate)."""
    steps = slow_steps(served.engine, monkeypatch)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 100, "ignore_eos": True}
    try:
        response = httpx.post(f"{served.url}/v1/completions", json=body, timeout=1.0)
    except httpx.ReadTimeout:
        pass  # the client gave up after 1 s, as intended: 100 steps take 3 s or more
    else:
        message = response.json().get("error", {}).get("message", response.text)
        if "Lab 16.3" in message:
            pytest.fail(f"{message}: a lab region is not written yet.", pytrace=False)
        pytest.fail(f"the server answered before 100 slowed steps could run: {message}")
    problem = held_after_disconnect(served)
    assert problem is None, problem
    assert len(steps) < 100, f"the request ran all {len(steps)} steps: it was never aborted"


@pytest.mark.points(4)
@pytest.mark.timeout(180)
def test_concurrent_streams_lose_nothing(served, offline_llm):
    """16 streaming clients at once; each text must equal LLM.generate's."""
    num_clients = 16
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(num_clients)]
    max_tokens = [6 + i % 7 for i in range(num_clients)]
    want = offline_llm.generate(
        prompts,
        [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens],
        use_tqdm=False,
    )

    async def one(aclient, prompt, max_tokens) -> str:
        stream = await aclient.completions.create(
            model=MODEL, prompt=prompt, temperature=0, max_tokens=max_tokens, stream=True
        )
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def run_all():
        aclient = openai.AsyncOpenAI(
            base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=60
        )
        async with aclient:
            return await asyncio.gather(
                *(one(aclient, p, m) for p, m in zip(prompts, max_tokens, strict=True))
            )

    try:
        got = asyncio.run(run_all())
    except openai.APIError as e:
        pytest.fail(f"a client got an error: {e.message}", pytrace=False)
    except openai.APITimeoutError:
        pytest.fail("a client got no answer in 60 s: an output never reached it", pytrace=False)
    lost = [
        (k, w.outputs[0].text, g)
        for k, (w, g) in enumerate(zip(want, got, strict=True))
        if w.outputs[0].text != g
    ]
    assert not lost, (
        f"{len(lost)} of {num_clients} concurrent streams differ from LLM.generate "
        f"((client, expected, yours), first three): {lost[:3]}. Each output must go to its own "
        "request's collector, and get() must hand over everything pending."
    )
    assert not wait_until_idle(served.engine) and all_blocks_free(served.engine)


@pytest.mark.points(3)
@pytest.mark.timeout(120)
def test_abort_forgets_the_request_here_and_frees_it_in_the_core(impl, tiny_model, loop):
    engine = impl.async_llm.AsyncLLM(LLM(tiny_model, **ENGINE_ARGS).llm_engine, MODEL)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    async def scenario():
        stream = engine.generate(PROMPTS[0], params, "req-1")
        await stream.__anext__()  # it runs
        engine.abort("req-1")
        engine.abort(["req-1", "never-seen"])  # twice, and an unknown id: harmless
        return stream

    try:
        stream = loop.run_until_complete(scenario())
        assert "req-1" not in engine.collectors, "abort() drops the request's collector"
        assert "req-1" not in engine.output_processor.request_states, (
            "abort() makes the output processor forget the request"
        )
        held = wait_until_idle(engine)
        assert not held, (
            f"the engine core still runs {held}: abort() must send the ids the output "
            "processor knew to self.engine_core.abort_requests"
        )
        assert all_blocks_free(engine), "the aborted request's KV blocks are freed"
        loop.run_until_complete(stream.aclose())
    except NotImplementedError as e:
        pytest.fail(f"{e}: a lab region is not written yet.", pytrace=False)
    finally:
        engine.shutdown()
        loop.run_until_complete(asyncio.sleep(0))
