"""``mini-vllm serve``: its arguments and its one-line errors (the server itself: test_serve.py)."""

from __future__ import annotations

import pytest

from mini_vllm.entrypoints import cli


def test_serve_help_lists_the_server_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "mini-vllm serve" in out and "--port" in out and "--served-model-name" in out


def test_serve_with_a_missing_model_is_one_error_line(capsys, tmp_path):
    code = cli.main(["serve", str(tmp_path / "no-such-model"), "--port", "0"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("mini-vllm serve: error:") and "Traceback" not in err


def test_the_offline_cli_still_takes_a_prompt(capsys):
    # "serve" is only a subcommand in first position; otherwise the offline parser runs.
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    assert "--prompt" in capsys.readouterr().out


def test_the_serve_command_answers_the_openai_client_and_stops_on_ctrl_c(tmp_path):
    """What `make serve` runs, as a user runs it: `python -m mini_vllm serve MODEL
    --port P` in its own process; the official client gets the same greedy text
    as LLM.generate, and Ctrl-C (SIGINT) shuts the server down with exit 0."""
    import signal
    import socket
    import subprocess
    import sys
    import time

    import openai
    from serve_helpers import tiny_text_model

    from mini_vllm.entrypoints.llm import LLM
    from mini_vllm.sampling_params import SamplingParams

    model = tiny_text_model()
    with socket.socket() as s:  # a free port (the kernel's pick, released at once)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = (tmp_path / "serve.log").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mini_vllm", "serve", model, "--port", str(port)]
        + ["--max-model-len", "256"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0
        )
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"the server exited: {(tmp_path / 'serve.log').read_text()}"
            try:
                served = [m.id for m in client.models.list().data]
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, "the server did not start in 180 s"
                time.sleep(0.5)
        assert served == [model]
        answer = client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=6, temperature=0
        )
        want = LLM(model, max_model_len=256).generate(
            ["The capital of France is"], SamplingParams(max_tokens=6, temperature=0)
        )
        assert answer.choices[0].text == want[0].outputs[0].text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, (tmp_path / "serve.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_a_server_stopped_while_it_holds_blocks_prints_no_traceback(tmp_path):
    """A prefill server (ZmqConnector) keeps a finished request's blocks for its
    reader, so its engine-core thread goes on stepping; Ctrl-C must stop that
    thread before the event loop closes: exit 0 and nothing after uvicorn's
    "Shutting down" but its own INFO lines (before the fix: "Exception in
    thread EngineCore ... RuntimeError: Event loop is closed")."""
    import os
    import signal
    import socket
    import subprocess

    import httpx
    from serve_helpers import tiny_text_model

    from mini_vllm.entrypoints.disagg_proxy import server_command, wait_until_healthy

    ports = []
    for _ in range(2):
        with socket.socket() as s:  # free ports (the kernel's pick, released at once)
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    cmd = server_command(
        *ports, tiny_text_model(), "--max-model-len", "256", "--kv-cache-memory-bytes",
        str(32 << 20), policy="fail", kv_lease_duration=60.0,
    )  # fmt: skip
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{ports[0]}"
        wait_until_healthy(url, proc, timeout=180)
        body = {"prompt": "The capital of France is", "max_tokens": 1}
        body["kv_transfer_params"] = {"do_remote_decode": True}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.json()["kv_transfer_params"]["remote_block_ids"]  # blocks held
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    after = text[text.index("Shutting down") :].splitlines()[1:]
    assert after and all(line.startswith("INFO:") for line in after), text


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("{method: ngram}", "--speculative-config is not JSON"),
        ('{"method": "eagle", "num_speculative_tokens": 3}', "method must be 'ngram'"),
        ('{"method": "ngram", "num_speculative_tokens": 3, "model": "x"}', "unsupported keys"),
    ],
)
def test_a_bad_speculative_config_is_one_error_line(capsys, value, says):
    code = cli.main(["serve", "--speculative-config", value, "--port", "0"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("mini-vllm serve: error: --speculative-config") and says in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_the_speculative_config_flag_reaches_the_served_engine():
    """``-sc`` reaches the served engine (its config, and /metrics has the
    speculative-decoding counters, which exist only with one) and greedy
    token ids equal LLM.generate's without it. (The tiny random model never
    repeats itself, so nothing is drafted here; the capstone's SmolLM2 run,
    mini_vllm/grading/capstone.py, drafts and compares the counters.)"""
    import argparse
    import re

    import httpx
    from serve_helpers import tiny_text_model

    from mini_vllm.entrypoints.llm import LLM
    from mini_vllm.entrypoints.openai.api_server import (
        ServerThread,
        add_server_args,
        build_async_engine_client,
    )
    from mini_vllm.sampling_params import SamplingParams

    model, prompt = tiny_text_model(), "1, 2, 3, 1, 2, 3, 1, 2, 3, 1,"
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    argv = [model, "-sc", spec, "--max-model-len", "256", "--device", "cpu"]
    args = add_server_args(argparse.ArgumentParser()).parse_args(argv)
    engine = build_async_engine_client(args)
    assert engine.vllm_config.speculative_config.num_speculative_tokens == 3
    server = ServerThread(engine, model, "tiny")
    try:
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
        got = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        metrics = httpx.get(f"{server.url}/metrics").text
    finally:
        server.stop()
    want = LLM(model, max_model_len=256, device="cpu").generate(
        [prompt], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False
    )
    assert got["choices"][0]["token_ids"] == list(want[0].outputs[0].token_ids)
    assert re.search(r"^vllm:spec_decode_num_draft_tokens_total\{.*\} \S+$", metrics, re.M)
