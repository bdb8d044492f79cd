"""The OpenAI-compatible server, driven by the official ``openai`` client (issue 16).

A real server (uvicorn, loopback, a port the kernel picks) over an AsyncLLM on
the tiny seeded Llama with SmolLM2's tokenizer. Every expected text comes from
``LLM.generate`` / ``LLM.chat`` on a second instance of the same model, run on
the same requests; a disconnect or a failed step must leave every KV block free.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest
from serve_helpers import tiny_text_model, wait_until_idle

from mini_vllm.engine.async_llm import AsyncLLM
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.entrypoints.openai.api_server import ServerThread
from mini_vllm.model_executor.model_loader import smollm2_gguf_path
from mini_vllm.sampling_params import SamplingParams

MODEL_NAME = "tiny-llama"
ENGINE_ARGS = dict(max_model_len=256, num_gpu_blocks_override=256, device="cpu", max_num_seqs=64)
PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "The three primary colors are",
]


@pytest.fixture(scope="module")
def model_path() -> str:
    return tiny_text_model()


@pytest.fixture(scope="module")
def llm(model_path) -> LLM:
    """The reference: the same model offline."""
    return LLM(model_path, **ENGINE_ARGS)


@pytest.fixture(scope="module")
def server(model_path):
    engine = AsyncLLM.from_model(model_path, model_name=MODEL_NAME, **ENGINE_ARGS)
    server = ServerThread(engine, model_path, MODEL_NAME)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def reference(llm: LLM, prompt, **params):
    return llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0]


def num_free_blocks(engine: AsyncLLM) -> int:
    return engine.llm_engine.engine_core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def all_blocks_free(engine: AsyncLLM) -> bool:
    # Every block but the null block.
    return num_free_blocks(engine) == engine.vllm_config.cache_config.num_gpu_blocks - 1


def metric(server: ServerThread, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    match = re.search(
        rf'^{re.escape(name)}\{{engine="0",model_name="{MODEL_NAME}"\}} (\S+)$', text, re.M
    )
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def test_greedy_completions_equal_llm_generate(client, llm):
    for prompt in PROMPTS:
        want = reference(llm, prompt, temperature=0, max_tokens=12)
        got = client.completions.create(
            model=MODEL_NAME, prompt=prompt, temperature=0, max_tokens=12
        )
        assert got.choices[0].text == want.outputs[0].text
        assert got.choices[0].finish_reason == want.outputs[0].finish_reason
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        assert got.usage.completion_tokens == len(want.outputs[0].token_ids)
        assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_a_prompt_list_and_token_ids_give_one_choice_each(client, llm):
    token_prompt = llm.get_tokenizer().encode(PROMPTS[0])
    got = client.completions.create(
        model=MODEL_NAME, prompt=[PROMPTS[1], PROMPTS[2]], temperature=0, max_tokens=6
    )
    assert [c.index for c in got.choices] == [0, 1]
    for choice, prompt in zip(got.choices, PROMPTS[1:3], strict=True):
        assert choice.text == reference(llm, prompt, temperature=0, max_tokens=6).outputs[0].text
    by_ids = client.completions.create(
        model=MODEL_NAME, prompt=token_prompt, temperature=0, max_tokens=6
    )
    want = reference(llm, {"prompt_token_ids": token_prompt}, temperature=0, max_tokens=6)
    assert by_ids.choices[0].text == want.outputs[0].text


def test_streamed_deltas_concatenate_to_the_whole_text_with_usage(client):
    for prompt in PROMPTS[:2]:
        whole = client.completions.create(
            model=MODEL_NAME, prompt=prompt, temperature=0, max_tokens=20
        )
        chunks = list(
            client.completions.create(
                model=MODEL_NAME,
                prompt=prompt,
                temperature=0,
                max_tokens=20,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        text_chunks, usage_chunk = chunks[:-1], chunks[-1]
        assert len(text_chunks) > 1
        assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
        assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
        assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
        assert usage_chunk.choices == []
        assert usage_chunk.usage.model_dump() == whole.usage.model_dump()
        assert len({c.id for c in chunks}) == 1


def test_return_token_ids_are_the_engines_whole_and_streamed(client, llm):
    """Upstream's ``return_token_ids`` (completion/protocol.py:142, chat_completion/
    protocol.py:365): the prompt's ids and the output's beside the text; streamed,
    the prompt's on the first chunk and each chunk's new ids."""
    ids = {"return_token_ids": True}
    for prompt in PROMPTS[:2]:
        want = reference(llm, prompt, temperature=0, max_tokens=12)
        got = client.completions.create(
            model=MODEL_NAME, prompt=prompt, temperature=0, max_tokens=12, extra_body=ids
        ).choices[0]
        assert got.prompt_token_ids == list(want.prompt_token_ids)
        assert got.token_ids == list(want.outputs[0].token_ids)
        chunks = list(
            client.completions.create(
                model=MODEL_NAME,
                prompt=prompt,
                temperature=0,
                max_tokens=12,
                stream=True,
                extra_body=ids,
            )
        )
        assert chunks[0].choices[0].prompt_token_ids == list(want.prompt_token_ids)
        assert all(c.choices[0].prompt_token_ids is None for c in chunks[1:])
        streamed = [t for c in chunks for t in c.choices[0].token_ids]
        assert streamed == list(want.outputs[0].token_ids)
    want = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    got = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, temperature=0, max_tokens=10, extra_body=ids
    )
    assert got.prompt_token_ids == list(want.prompt_token_ids)
    assert got.choices[0].token_ids == list(want.outputs[0].token_ids)
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=CHAT,
            temperature=0,
            max_tokens=10,
            stream=True,
            extra_body=ids,
        )
    )
    assert chunks[0].prompt_token_ids == list(want.prompt_token_ids)
    streamed = [t for c in chunks[1:] for t in c.choices[0].token_ids]
    assert streamed == list(want.outputs[0].token_ids)
    # Not asked for: no ids.
    plain = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], temperature=0, max_tokens=4
    ).choices[0]
    assert plain.token_ids is None and plain.prompt_token_ids is None


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_a_return_token_ids_that_is_not_a_bool_is_a_400_naming_it(server, endpoint):
    body = {"return_token_ids": "sometimes", "max_tokens": 2}
    body.update({"prompt": "x"} if endpoint == "completions" else {"messages": CHAT})
    response = httpx.post(f"{server.url}/v1/{endpoint}", json=body)
    assert_openai_error(response, 400)
    assert "return_token_ids" in response.json()["error"]["message"]


def test_sse_framing_ends_with_done(server):
    body = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(response.iter_bytes()).decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ")
        json.loads(event[len("data: ") :])


def test_n_choices_are_seeded_children(client, llm):
    got = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], n=3, temperature=0.9, seed=7, max_tokens=10
    )
    # As upstream's ParentRequest: child i samples with seed + i.
    want = [
        reference(llm, PROMPTS[0], temperature=0.9, seed=7 + i, max_tokens=10).outputs[0]
        for i in range(3)
    ]
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [w.text for w in want]
    assert len({w.text for w in want}) > 1  # the seeds differ
    assert got.usage.completion_tokens == sum(len(w.token_ids) for w in want)
    streamed = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[0],
        n=3,
        temperature=0.9,
        seed=7,
        max_tokens=10,
        stream=True,
    )
    texts = ["", "", ""]
    for chunk in streamed:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [c.text for c in got.choices]


def test_stop_string_ends_the_completion(client, llm):
    full = reference(llm, PROMPTS[1], temperature=0, max_tokens=20).outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    want = reference(llm, PROMPTS[1], temperature=0, max_tokens=20, stop=[stop]).outputs[0]
    assert want.finish_reason == "stop"
    got = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], temperature=0, max_tokens=20, stop=[stop]
    )
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == "stop"
    assert got.model_extra is not None and got.choices[0].model_extra["stop_reason"] == stop
    streamed = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], temperature=0, max_tokens=20, stop=[stop], stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == want.text


def test_logprobs_are_the_engines(client, llm):
    want = reference(llm, PROMPTS[2], temperature=0, max_tokens=6, logprobs=2).outputs[0]
    got = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[2], temperature=0, max_tokens=6, logprobs=2
    ).choices[0]
    tokenizer = llm.get_tokenizer()
    assert got.logprobs.tokens == [tokenizer.decode([t]) for t in want.token_ids]
    assert got.logprobs.token_logprobs == pytest.approx(
        [step[t] for step, t in zip(want.logprobs, want.token_ids, strict=True)]
    )
    assert all(1 <= len(top) <= 3 for top in got.logprobs.top_logprobs)
    assert got.logprobs.text_offset[0] == 0


def test_chat_uses_the_models_template(client, llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want = llm.chat(messages, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    got = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, temperature=0, max_tokens=10
    )
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            temperature=0,
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == want.outputs[0].text
    assert chunks[-1].usage.completion_tokens == len(want.outputs[0].token_ids)


def test_models_health_and_metrics(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert httpx.get(f"{server.url}/health").status_code == 200
    before = {
        name: metric(server, name)
        for name in (
            "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total",
            "vllm:prefix_cache_queries_total",
        )
    }
    success = 'vllm:request_success_total{engine="0",finished_reason="length",model_name='
    got = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[3], max_tokens=7)
    wait_until_idle(server.engine)
    assert metric(server, "vllm:prompt_tokens_total") - before["vllm:prompt_tokens_total"] == (
        got.usage.prompt_tokens
    )
    assert (
        metric(server, "vllm:generation_tokens_total") - before["vllm:generation_tokens_total"]
        == got.usage.completion_tokens
    )
    assert (
        metric(server, "vllm:prefix_cache_queries_total")
        > before["vllm:prefix_cache_queries_total"]
    )
    text = httpx.get(f"{server.url}/metrics").text
    assert success in text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert metric(server, name) == 0
    assert metric(server, "vllm:kv_cache_usage_perc") == 0


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None):
    assert response.status_code == status
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status and body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param


def test_errors_are_openai_shaped_and_the_server_keeps_serving(client, server, llm):
    url = f"{server.url}/v1/completions"
    assert_openai_error(httpx.post(url, json={"model": "nope", "prompt": "x"}), 404, "model")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    too_long = list(range(5, 5 + ENGINE_ARGS["max_model_len"]))
    assert_openai_error(httpx.post(url, json={"model": MODEL_NAME, "prompt": too_long}), 400)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=MODEL_NAME, prompt="x", extra_body={"use_beam_search": True}
        )
    assert e.value.body["param"] == "use_beam_search"
    assert_openai_error(
        httpx.post(url, json={"model": MODEL_NAME, "prompt": "x", "temperature": -1}), 400
    )
    assert_openai_error(
        httpx.post(url, content=b'{"prompt": ', headers={"content-type": "application/json"}),
        400,
    )
    assert_openai_error(httpx.post(url, json={"model": MODEL_NAME}), 400)
    chat_url = f"{server.url}/v1/chat/completions"
    assert_openai_error(
        httpx.post(chat_url, json={"messages": [{"role": "user", "content": "hi"}], "tools": []}),
        400,
        "tools",
    )
    got = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], temperature=0, max_tokens=5
    )
    assert (
        got.choices[0].text
        == reference(llm, PROMPTS[0], temperature=0, max_tokens=5).outputs[0].text
    )
    wait_until_idle(server.engine)
    assert all_blocks_free(server.engine)


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(server):
    body = {"model": MODEL_NAME, "prompt": PROMPTS[1], "max_tokens": 200, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        events = response.iter_lines()
        first = next(line for line in events if line.startswith("data: "))
        assert json.loads(first[len("data: ") :])["choices"][0]["finish_reason"] is None
        assert server.engine.llm_engine.engine_core.scheduler.requests  # still generating
    # The connection is closed: the server must abort the request.
    wait_until_idle(server.engine)
    assert all_blocks_free(server.engine)
    assert metric(server, "vllm:num_requests_running") == 0


def test_a_client_that_leaves_before_a_whole_answer_frees_its_blocks(server):
    """Non-streamed: the handler is cancelled on disconnect (with_cancellation)."""
    runner = server.engine.llm_engine.engine_core.model_runner
    real_execute = runner.execute_model
    steps = []

    def slow_execute(scheduler_output, *args):
        steps.append(1)
        time.sleep(0.05)  # 200 tokens take 10 s: the client leaves long before
        return real_execute(scheduler_output, *args)

    body = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True}
    runner.execute_model = slow_execute
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=1.0)
        wait_until_idle(server.engine)
    finally:
        runner.execute_model = real_execute
    assert len(steps) < 200  # aborted, not finished
    assert all_blocks_free(server.engine)


def test_a_failed_step_fails_its_requests_only(client, server, llm):
    runner = server.engine.llm_engine.engine_core.model_runner
    real_execute = runner.execute_model
    calls = []

    def fail_once(scheduler_output, *args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected step failure")
        return real_execute(scheduler_output, *args)

    runner.execute_model = fail_once
    try:
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=5)
    finally:
        runner.execute_model = real_execute
    wait_until_idle(server.engine)
    assert all_blocks_free(server.engine)
    got = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[2], temperature=0, max_tokens=5
    )
    assert (
        got.choices[0].text
        == reference(llm, PROMPTS[2], temperature=0, max_tokens=5).outputs[0].text
    )


def test_a_failure_in_output_processing_fails_its_requests_only(client, server, llm):
    processor = server.engine.output_processor
    real_process = processor.process_outputs
    calls = []
    # Outputs of an earlier test's requests may still be on their way to the
    # processor on a busy machine: only this test's request gets the failure.
    wait_until_idle(server.engine)
    earlier = set(processor.request_states)

    def fail_once(outputs):
        if not calls and any(o.request_id not in earlier for o in outputs.outputs):
            calls.append(1)
            raise RuntimeError("injected detokenizer failure")
        return real_process(outputs)

    processor.process_outputs = fail_once
    try:
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model=MODEL_NAME, prompt=PROMPTS[3], max_tokens=5)
    finally:
        processor.process_outputs = real_process
    wait_until_idle(server.engine)
    assert all_blocks_free(server.engine)
    got = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[3], temperature=0, max_tokens=5
    )
    want = reference(llm, PROMPTS[3], temperature=0, max_tokens=5)
    assert got.choices[0].text == want.outputs[0].text


def test_a_request_the_scheduler_refuses_fails_alone(client, server, llm):
    scheduler = server.engine.llm_engine.engine_core.scheduler
    real_add = scheduler.add_request

    def refuse(request):
        raise ValueError("injected refusal")

    scheduler.add_request = refuse
    try:
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=5)
    finally:
        scheduler.add_request = real_add
    assert server.engine.check_health()
    got = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], temperature=0, max_tokens=5
    )
    want = reference(llm, PROMPTS[0], temperature=0, max_tokens=5)
    assert got.choices[0].text == want.outputs[0].text
    assert not server.engine.output_processor.request_states


def test_concurrent_streaming_clients_lose_nothing(server, llm):
    """48 streaming clients at once; each text is checked against LLM.generate."""
    num_clients = 48
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(num_clients)]
    max_tokens = [8 + i % 9 for i in range(num_clients)]
    want = llm.generate(
        prompts,
        [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens],
        use_tqdm=False,
    )

    async def one(aclient: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> str:
        stream = await aclient.completions.create(
            model=MODEL_NAME, prompt=prompt, temperature=0, max_tokens=max_tokens, stream=True
        )
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def run_all() -> list[str]:
        aclient = openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120
        )
        return await asyncio.gather(
            *(one(aclient, p, m) for p, m in zip(prompts, max_tokens, strict=True))
        )

    got = asyncio.run(run_all())
    assert got == [w.outputs[0].text for w in want]
    wait_until_idle(server.engine)
    assert all_blocks_free(server.engine)


def test_smollm2_over_the_server_equals_llm():
    """The real model: LLM.generate and LLM.chat first, then the same engine served."""
    path = str(smollm2_gguf_path())
    llm = LLM(path, max_model_len=256, kv_cache_memory_bytes=16 << 20, device="cpu")
    params = SamplingParams(temperature=0, max_tokens=8)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].text
    want_chat = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
    server = ServerThread(AsyncLLM(llm.llm_engine, "smollm2"), path, "smollm2")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        got = client.completions.create(
            model="smollm2", prompt=PROMPTS[0], temperature=0, max_tokens=8
        )
        assert got.choices[0].text == want
        chat = client.chat.completions.create(
            model="smollm2", messages=messages, temperature=0, max_tokens=8, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in chat) == want_chat
    finally:
        server.stop()


def test_the_serving_benchmark_runs_and_counts_every_token():
    from mini_vllm.benchmarks.serve import markdown, run_benchmark

    report = run_benchmark(
        tiny_text_model(), 6, 8, [1, 3], enable_prefix_caching=False, **ENGINE_ARGS
    )
    assert [r["concurrency"] for r in report["server"]] == [1, 3]
    assert all(r["tokens"] == 6 * 8 for r in report["server"])
    assert all(r["ttft_s"]["p50"] > 0 and r["tpot_s"]["p50"] > 0 for r in report["server"])
    table = markdown(report)
    # Two header lines, the LLM.generate ceiling, one row per level; then the conditions.
    assert sum(line.startswith("|") for line in table.splitlines()) == 5
    assert report["torch_threads"] >= 1 and report["load_average_1m"] >= 0
    assert table.endswith(
        f"torch threads {report['torch_threads']}, load average {report['load_average_1m']:.2f}"
    )


# --------------------------------------------- issue 29: the server as clients use it

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def reference_chat(llm: LLM, messages=CHAT, **params):
    return llm.chat(messages, SamplingParams(**params), use_tqdm=False)[0]


def test_chat_max_completion_tokens_zero_is_refused_not_unlimited(client, server):
    """Item 1. Upstream passes 0 on (`is not None`, chat_completion/serving.py:294) and
    SamplingParams refuses max_tokens < 1 (vllm/sampling_params.py:500): a 400."""
    with pytest.raises(openai.BadRequestError, match="max_tokens must be at least 1"):
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_completion_tokens=0)
    # 0 is a value, not "unset": it wins over max_tokens as any other value would.
    body = {"messages": CHAT, "max_completion_tokens": 0, "max_tokens": 5, "stream": True}
    assert_openai_error(httpx.post(f"{server.url}/v1/chat/completions", json=body), 400)
    wait_until_idle(server.engine)
    assert all_blocks_free(server.engine)


STREAM_REFUSALS = [
    # (endpoint, body, param): each a 400 before the first byte, as upstream where it can.
    ("completions", {"prompt": "", "stream": True}, None),
    ("completions", {"prompt": "x", "stream": True, "logprobs": 50}, None),
    ("completions", {"prompt": "x", "stream": True, "max_tokens": 0}, None),
    ("completions", {"prompt": [[]], "stream": True}, None),
    (
        "chat/completions",
        {"messages": CHAT, "stream": True, "logprobs": True, "top_logprobs": 50},
        None,
    ),
    (
        "completions",
        {"prompt": "x", "stream": True, "structured_outputs": {"regex": "(unclosed"}},
        None,
    ),
]


@pytest.mark.parametrize(("endpoint", "body", "param"), STREAM_REFUSALS)
def test_a_stream_that_cannot_run_is_a_400_before_the_stream_starts(server, endpoint, body, param):
    """Item 2: everything that can be validated is, before the first byte of a stream."""
    with httpx.stream("POST", f"{server.url}/v1/{endpoint}", json=body) as response:
        response.read()
    assert not response.headers["content-type"].startswith("text/event-stream"), response.text
    assert_openai_error(response, 400, param)


def test_the_openai_client_gets_an_empty_prompt_refused(client):
    with pytest.raises(openai.BadRequestError, match="non-empty"):
        client.completions.create(model=MODEL_NAME, prompt="", stream=True)


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_stream_options_without_stream_is_refused_naming_it(server, endpoint):
    """Item 3: upstream's validate_stream_options (completion/protocol.py:425-434)."""
    body = {"stream_options": {"include_usage": True}}
    body.update({"prompt": "x"} if endpoint == "completions" else {"messages": CHAT})
    assert_openai_error(httpx.post(f"{server.url}/v1/{endpoint}", json=body), 400, "stream_options")
    body["stream"] = False
    assert_openai_error(httpx.post(f"{server.url}/v1/{endpoint}", json=body), 400, "stream_options")


def test_response_format_text_is_plain_generation(client, llm):
    """Item 4: `{"type": "text"}` is OpenAI's default; upstream's ResponseFormat takes it."""
    want = reference_chat(llm, temperature=0, max_tokens=8)
    got = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        temperature=0,
        max_tokens=8,
        response_format={"type": "text"},
    )
    assert got.choices[0].message.content == want.outputs[0].text
    plain = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[0],
        temperature=0,
        max_tokens=5,
        extra_body={"response_format": {"type": "text"}},
    )
    assert (
        plain.choices[0].text
        == reference(llm, PROMPTS[0], temperature=0, max_tokens=5).outputs[0].text
    )


SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["answer"],
    "additionalProperties": False,
}


def test_structured_outputs_over_http_equal_the_engines(client, llm):
    """Item 5: response_format json_schema / json_object and vLLM's structured_outputs
    reach the engine's StructuredOutputsParams as upstream's to_sampling_params maps them
    (chat_completion/protocol.py:578-608)."""
    from mini_vllm.sampling_params import StructuredOutputsParams

    cases = [
        (
            {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}},
            StructuredOutputsParams(json=SCHEMA),
        ),
        ({"type": "json_object"}, StructuredOutputsParams(json_object=True)),
    ]
    for response_format, constraint in cases:
        want = reference_chat(llm, temperature=0, max_tokens=24, structured_outputs=constraint)
        got = client.chat.completions.create(
            model=MODEL_NAME,
            messages=CHAT,
            temperature=0,
            max_tokens=24,
            response_format=response_format,
        )
        assert got.choices[0].message.content == want.outputs[0].text, response_format
        assert got.choices[0].finish_reason == want.outputs[0].finish_reason
    choice = ["maybe", "never"]
    want = reference(
        llm,
        PROMPTS[1],
        temperature=0,
        max_tokens=8,
        structured_outputs=StructuredOutputsParams(choice=choice),
    ).outputs[0]
    got = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[1],
        temperature=0,
        max_tokens=8,
        extra_body={"structured_outputs": {"choice": choice}},
    ).choices[0]
    assert got.text == want.text and got.text in choice
    streamed = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[1],
        temperature=0,
        max_tokens=8,
        stream=True,
        extra_body={"structured_outputs": {"choice": choice}},
    )
    assert "".join(c.choices[0].text for c in streamed) == want.text


def test_a_bad_schema_is_a_400_for_that_request_only(client, server, llm):
    url = f"{server.url}/v1/chat/completions"
    bad_schema = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
    }
    for body in [
        {"messages": CHAT, "response_format": bad_schema},
        {"messages": CHAT, "response_format": bad_schema, "stream": True},
        {"messages": CHAT, "response_format": {"type": "json_schema"}},
        {"messages": CHAT, "structured_outputs": {"choice": ["a"], "regex": "a"}},
        {"messages": CHAT, "structured_outputs": {}},
        {"messages": CHAT, "response_format": {"type": "xml"}},
    ]:
        assert_openai_error(httpx.post(url, json=body), 400)
    assert_openai_error(
        httpx.post(url, json={"messages": CHAT, "response_format": {"type": "json_schema"}}),
        400,
        "response_format",
    )
    want = reference_chat(llm, temperature=0, max_tokens=6)
    got = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, temperature=0, max_tokens=6
    )
    assert got.choices[0].message.content == want.outputs[0].text
    wait_until_idle(server.engine)
    assert all_blocks_free(server.engine)


def test_chat_logprobs_are_the_engines_in_openais_shape(client, llm):
    """Item 6: upstream's _create_chat_logprobs (chat_completion/serving.py:1467): per token
    its text, logprob and UTF-8 bytes, and the first top_logprobs entries of the engine's
    dict (the sampled token first)."""
    want = reference_chat(llm, temperature=0, max_tokens=6, logprobs=2).outputs[0]
    tokenizer = llm.get_tokenizer()
    got = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, temperature=0, max_tokens=6, logprobs=True, top_logprobs=2
    ).choices[0]
    content = got.logprobs.content
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in want.token_ids]
    assert [c.logprob for c in content] == pytest.approx(
        [step[t] for step, t in zip(want.logprobs, want.token_ids, strict=True)]
    )
    assert [c.bytes for c in content] == [list(c.token.encode()) for c in content]
    for entry, step in zip(content, want.logprobs, strict=True):
        assert [top.token for top in entry.top_logprobs] == [
            tokenizer.decode([t]) for t in list(step)[:2]
        ]
        assert [top.logprob for top in entry.top_logprobs] == pytest.approx(list(step.values())[:2])
    # logprobs without top_logprobs: each token's own logprob, no alternatives.
    only = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, temperature=0, max_tokens=6, logprobs=True
    ).choices[0]
    assert [c.logprob for c in only.logprobs.content] == pytest.approx([c.logprob for c in content])
    assert all(c.top_logprobs == [] for c in only.logprobs.content)
    streamed = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        temperature=0,
        max_tokens=6,
        logprobs=True,
        top_logprobs=2,
        stream=True,
    )
    streamed_content = [
        entry
        for chunk in streamed
        if chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    assert [c.model_dump() for c in streamed_content] == [c.model_dump() for c in content]
    plain = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, temperature=0, max_tokens=6
    ).choices[0]
    assert plain.logprobs is None


def test_top_logprobs_without_logprobs_is_refused_naming_it(server):
    """Upstream's check_logprobs (chat_completion/protocol.py:686-716)."""
    url = f"{server.url}/v1/chat/completions"
    assert_openai_error(
        httpx.post(url, json={"messages": CHAT, "top_logprobs": 2}), 400, "top_logprobs"
    )
    assert_openai_error(
        httpx.post(url, json={"messages": CHAT, "logprobs": True, "top_logprobs": -2}),
        400,
        "top_logprobs",
    )


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_health_answers_while_a_huge_prompt_is_tokenized(server, endpoint):
    """Item 7: tokenization runs off the event loop. The tokenizer is held inside a
    real 1 MB prompt's tokenization until /health has answered: on the event loop,
    /health could not answer until tokenization ended."""
    import threading

    tokenizer = server.engine.tokenizer
    name = "encode" if endpoint == "completions" else "apply_chat_template"
    real = getattr(tokenizer, name)
    entered, answered = threading.Event(), threading.Event()

    def held(*args, **kwargs):
        entered.set()
        answered.wait(timeout=10)
        return real(*args, **kwargs)

    text = "The capital of France is Paris. " * (1 << 15)  # 1 MB
    body = {"model": MODEL_NAME, "max_tokens": 4}
    body.update(
        {"prompt": text}
        if endpoint == "completions"
        else {"messages": [{"role": "user", "content": text}]}
    )
    setattr(tokenizer, name, held)
    try:
        with concurrent_post(f"{server.url}/v1/{endpoint}", body) as huge:
            assert entered.wait(timeout=30), "the huge prompt never reached the tokenizer"
            try:
                health = httpx.get(f"{server.url}/health", timeout=5)
            except httpx.TimeoutException:
                health = None
            answered.set()
            response = huge.result(timeout=60)
    finally:
        delattr(tokenizer, name)
    assert health is not None and health.status_code == 200, (
        "/health did not answer while a prompt was being tokenized: tokenization blocks the "
        "event loop"
    )
    assert_openai_error(response, 400)  # too long for the model, once tokenized


class concurrent_post:
    """POST in a worker thread; ``result`` waits for the response."""

    def __init__(self, url: str, body: dict) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(max_workers=1)
        self.future = self.pool.submit(httpx.post, url, json=body, timeout=60)

    def __enter__(self):
        return self.future

    def __exit__(self, *exc) -> None:
        self.pool.shutdown(wait=True)


FRAMEWORK_ERRORS = [
    ("POST", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400),
    ("POST", "/v1/chat/completions", b"\xff\xfe\xfd", 400),
    ("GET", "/v1/no-such-route", None, 404),
    ("POST", "/v2/completions", b"{}", 404),
    ("GET", "/v1/completions", None, 405),
    ("DELETE", "/health", None, 405),
]


@pytest.mark.parametrize(("method", "path", "content", "status"), FRAMEWORK_ERRORS)
def test_framework_errors_are_openai_shaped(server, method, path, content, status):
    """Item 8: upstream answers these with Starlette's {"detail": ...}; mini_vllm uses
    the one error shape everywhere."""
    headers = {"content-type": "application/json"} if content is not None else {}
    response = httpx.request(method, f"{server.url}{path}", content=content, headers=headers)
    assert_openai_error(response, status)
    if status == 405:
        assert response.headers.get("allow"), "a 405 names the methods allowed"


def test_shutdown_with_a_request_in_flight_aborts_it_and_frees_its_blocks(model_path):
    """What the server's lifespan runs on the way out: the engine-core thread
    stops, and the request it still held gives its KV blocks back."""
    engine = AsyncLLM.from_model(model_path, model_name=MODEL_NAME, **ENGINE_ARGS)
    scheduler = engine.llm_engine.engine_core.scheduler

    async def stop_mid_request():
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        stream = engine.generate(PROMPTS[0], params, "in-flight")
        await anext(stream)  # running, its blocks held
        assert scheduler.requests and not all_blocks_free(engine)
        engine.shutdown()
        await stream.aclose()

    asyncio.run(stop_mid_request())
    assert not scheduler.get_num_unfinished_requests()
    assert all_blocks_free(engine)
