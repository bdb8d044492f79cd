"""Disaggregated serving: a prefill server, a decode server, a proxy.

Real processes and sockets on localhost, as ``make disagg`` runs them: two
``python -m mini_vllm serve`` processes with ``--kv-transfer-config`` naming
the ZmqConnector, and mini_vllm/entrypoints/disagg_proxy.py in front (here on
a thread of the test process). Upstream's flow (its toy proxy,
tests/v1/kv_connector/nixl_integration/toy_proxy_server.py): prefill with
``max_tokens=1`` and ``do_remote_decode``, then decode with the
``kv_transfer_params`` the prefill server returned.
- Greedy text through the proxy equals one engine's, the decode server
  pulled the prompt's KV (it prefilled only the last prompt token), and both
  servers hold no block afterwards.
- ``kv_transfer_params`` round-trip: what the prefill server answers names
  its engine, its request, its side channel and the blocks it holds.
- The prefill server frees blocks that no decoder read, after its
  ``kv_lease_duration``.
- A prefill server killed (SIGKILL) after it answered and before the decode
  server read: that request alone fails on the decode side (both servers run
  ``kv_load_failure_policy="fail"``, so a text in the tests above means the
  KV really came over the wire; the recompute policy is
  tests/test_zmq_connector.py's), the decode server goes on serving, and it
  holds no block.
One pair of servers for the module; the kill test runs last. The model is
SmolLM2-135M in the deep tier (``make test-deep``) and the tiny seeded Llama
with SmolLM2's tokenizer in the fast tier, where three SmolLM2 loads on two
cores would take most of the tier's time; the code under test is the same.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
import time

import httpx
import pytest

from mini_vllm.entrypoints.disagg_proxy import build_app, server_command, wait_until_healthy
from mini_vllm.tiers import tier

# One pair of server processes for the module: keep it on one xdist worker.
pytestmark = pytest.mark.xdist_group("disagg")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Here is a short poem about the sea:"]
MAX_TOKENS = 8
LEASE_S = 5.0
SERVE_ARGS = ("--max-model-len", "256", "--max-num-seqs", "4", "--kv-cache-memory-bytes")
SERVE_ARGS += (str(32 << 20), "--no-prefix-caching")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return float(re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M).group(1))


def wait_for(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


@pytest.fixture(scope="module")
def model() -> str:
    if tier() == "deep":
        from mini_vllm.model_executor.model_loader import smollm2_gguf_path

        return str(smollm2_gguf_path())
    from serve_helpers import tiny_text_model

    return tiny_text_model()


class Pair:
    def __init__(self, tmp, model: str) -> None:
        self.ports = {name: free_port() for name in ("prefill", "decode", "p_side", "d_side")}
        self.urls = {n: f"http://127.0.0.1:{self.ports[n]}" for n in ("prefill", "decode")}
        self.procs = {}
        extra = {
            "prefill": {"kv_lease_duration": LEASE_S},
            "decode": {"kv_read_timeout": 2.0},
        }
        for name, side in (("prefill", "p_side"), ("decode", "d_side")):
            cmd = server_command(
                self.ports[name], self.ports[side], model, *SERVE_ARGS, policy="fail", **extra[name]
            )
            log = open(tmp / f"{name}.log", "w+")
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def start_proxy(self) -> None:
        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.proxy = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.app = build_app([self.urls["prefill"]], [self.urls["decode"]])
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        ).start()
        assert wait_for(lambda: self.server.started, 30)

    def stop(self) -> None:
        if hasattr(self, "server"):
            self.server.should_exit = True
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(scope="module")
def single(model):
    """One engine's greedy text for each prompt (computed while the pair starts)."""
    from mini_vllm.entrypoints.llm import LLM
    from mini_vllm.sampling_params import SamplingParams

    llm = LLM(model, max_model_len=256, kv_cache_memory_bytes=32 << 20)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    return {o.prompt: o.outputs[0].text for o in outs}


@pytest.fixture(scope="module")
def pair(tmp_path_factory, request, model):
    pair = Pair(tmp_path_factory.mktemp("disagg"), model)
    try:
        request.getfixturevalue("single")  # load the reference while the servers start
        for name in ("prefill", "decode"):
            wait_until_healthy(pair.urls[name], pair.procs[name])
        pair.start_proxy()
        yield pair
    finally:
        pair.stop()


def complete(url: str, prompt: str, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, **extra}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_the_pair_through_the_proxy_equals_one_engine(pair, single):
    for prompt in PROMPTS:
        # The decode server runs kv_load_failure_policy="fail": a text here
        # means the prompt's KV was read from the prefill server.
        out = complete(pair.proxy, prompt)
        assert out["choices"][0]["finish_reason"] == "length", out
        assert out["choices"][0]["text"] == single[prompt], prompt
        assert out["usage"]["completion_tokens"] == MAX_TOKENS
    # Both hold nothing, and the prefill server let go well before its lease
    # ran out: the decode server read every prompt's blocks.
    for name in ("prefill", "decode"):
        assert wait_for(
            lambda n=name: metric(pair.urls[n], "vllm:kv_cache_usage_perc") == 0.0, LEASE_S / 2
        ), f"{name} still holds blocks"


def test_kv_transfer_params_round_trip(pair):
    prefill = complete(
        pair.urls["prefill"],
        PROMPTS[0],
        max_tokens=1,
        kv_transfer_params={"do_remote_decode": True},
    )
    params = prefill["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_port"] == pair.ports["p_side"]
    assert params["remote_host"] == "127.0.0.1"
    assert params["remote_num_tokens"] == prefill["usage"]["prompt_tokens"]
    assert params["remote_block_ids"] and params["remote_engine_id"] and params["remote_request_id"]
    assert metric(pair.urls["prefill"], "vllm:kv_cache_usage_perc") > 0  # held for the reader
    # The decode server, given them directly, continues the prefill's first token.
    out = complete(pair.urls["decode"], PROMPTS[0], kv_transfer_params=params)
    assert out["choices"][0]["text"].startswith(prefill["choices"][0]["text"])
    assert wait_for(
        lambda: metric(pair.urls["prefill"], "vllm:kv_cache_usage_perc") == 0.0, LEASE_S / 2
    )


def chat_text(url: str, body: dict) -> str:
    """The answer's text, whole or gathered from the stream's deltas."""
    if not body.get("stream"):
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["message"]["content"]
    text = ""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["delta"].get("content") or ""
    return text


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_through_the_proxy_equals_one_engine(pair, stream):
    body = {
        "messages": [{"role": "user", "content": "Name a sea."}],
        "max_completion_tokens": MAX_TOKENS,
        "temperature": 0.0,
    }
    alone = chat_text(pair.urls["decode"], body)  # one engine, no transfer
    handed_over = pair.app.state.stats["requests"]
    assert chat_text(pair.proxy, {**body, "stream": stream}) == alone
    # The prefill server answered with kv_transfer_params and the decode server
    # (policy "fail") read the prompt's KV with them.
    assert pair.app.state.stats["requests"] == handed_over + 1


def test_prefill_server_frees_blocks_no_decoder_read(pair):
    complete(
        pair.urls["prefill"],
        PROMPTS[1],
        max_tokens=1,
        kv_transfer_params={"do_remote_decode": True},
    )
    start = time.monotonic()
    assert metric(pair.urls["prefill"], "vllm:kv_cache_usage_perc") > 0
    assert wait_for(lambda: metric(pair.urls["prefill"], "vllm:kv_cache_usage_perc") == 0.0, 20)
    assert time.monotonic() - start >= LEASE_S - 0.5


def test_killed_prefill_peer_fails_that_request_alone(pair, single):
    prefill = complete(
        pair.urls["prefill"],
        PROMPTS[2],
        max_tokens=1,
        kv_transfer_params={"do_remote_decode": True},
    )
    pair.procs["prefill"].kill()  # SIGKILL: its side channel dies with it
    pair.procs["prefill"].wait(timeout=10)
    out = complete(
        pair.urls["decode"], PROMPTS[2], kv_transfer_params=prefill["kv_transfer_params"]
    )
    assert out["choices"][0]["finish_reason"] == "error", out
    # The decode server goes on serving, and holds nothing.
    again = complete(pair.urls["decode"], PROMPTS[0])
    assert again["choices"][0]["text"] == single[PROMPTS[0]]
    assert wait_for(lambda: metric(pair.urls["decode"], "vllm:kv_cache_usage_perc") == 0.0)


def test_a_bad_kv_transfer_config_is_one_error_line(capsys):
    from mini_vllm.entrypoints import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--kv-transfer-config", '{"kv_connector": "ZmqConnector"}'])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--kv-transfer-config" in err and "kv_role must be set" in err, err
