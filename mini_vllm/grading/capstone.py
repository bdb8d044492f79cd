"""Phase 19's end-to-end grade: the student's whole engine served beside the
reference, the same requests sent to both with the official ``openai`` client.

``serve`` starts ``python -m mini_vllm serve`` in a subprocess on SmolLM2
with n-gram speculative decoding on (``--speculative-config``; with
``MINI_VLLM_STUDENT_PHASES`` set, the student's code of those phases runs
inside the reference's modules: see assemble.py). ``transcript`` sends the
requests and writes down what came back: greedy completions and chats, whole
and streamed, each with ``return_token_ids`` (the prompt's and the output's
token ids, the text, finish reason, token counts, and the tokens their
logprobs name: one a token, drafts accepted or not); four prompts
sent one at a time, then all four as concurrent streams; a chat constrained
to a choice (structured outputs); the speculative-decoding counters of
``/metrics`` (drafts, draft tokens, accepted tokens: greedy output is the
same with or without drafts, so a proposer that drafts other tokens shows
only there); and a client that disconnects mid-stream, after which
``/metrics`` must show every KV block free and nothing running. ``compare``
names the first entry that differs, and also wants each of the student's
concurrent streams equal to the reference's answer to the same request sent
alone. ``bisect`` names the first phase whose code makes it differ, by
running the student's phases 00..k with the reference's code for the rest.
There is no upstream counterpart.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from mini_vllm.grading import regions as R
from mini_vllm.grading.assemble import PHASES_ENV

START_TIMEOUT_S = 240
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
CHAT = [{"role": "user", "content": "Name a colour of the sky."}]
# Sent alone, then at once. The last two repeat themselves, so n-gram drafts
# are made and accepted; in the third a word recurs with other words after it,
# so where the proposer looks (earliest match or another) changes the drafts.
CONCURRENT = [
    f"{PROMPTS[0]} and",
    f"Once {PROMPTS[1]}",
    "red green blue red yellow blue red green",
    "1, 2, 3, 1, 2, 3, 1,",
]
MAX_TOKENS = 8
# Both servers draft alike (n-gram, Phase 08); greedy output must not change.
SPECULATIVE_CONFIG = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}
IDS = {"return_token_ids": True}
SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
)


class EngineDidNotStart(RuntimeError):
    """The server exited, or never answered ``/health``, before the requests."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve(
    labs: Path | None = None,
    phases: list[str] | None = None,
    speculative_config: dict | None = SPECULATIVE_CONFIG,
):
    """A SmolLM2 server's URL: the reference's, or with the student's code of
    ``phases`` from ``labs``; speculative decoding as ``speculative_config``
    says (None: off). The server is stopped on exit."""
    import httpx

    env = dict(os.environ, VLLM_LOGGING_STREAM="ext://sys.stderr")
    env.pop(PHASES_ENV, None)
    if phases:
        env[PHASES_ENV] = ",".join(phases)
        env["MINI_VLLM_LABS_DIR"] = str(Path(labs).resolve())
    port = _free_port()
    cmd = [sys.executable, "-m", "mini_vllm", "serve", "--port", str(port), "--max-num-seqs", "8"]
    if speculative_config is not None:
        cmd += ["--speculative-config", json.dumps(speculative_config)]
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    lines = log.read().decode(errors="replace").strip().splitlines()
                    raise EngineDidNotStart(lines[-1] if lines else f"exit status {proc.poll()}")
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _gauge(text: str, name: str) -> float | None:
    found = re.findall(rf"^{re.escape(name)}\{{.*\}} (\S+)$", text, re.M)
    return float(found[0]) if found else None


def transcript(url: str) -> dict[str, object]:
    """{what was asked: what came back}, in the order asked."""
    import httpx
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    greedy = dict(model=model, max_tokens=MAX_TOKENS, temperature=0, extra_body=IDS)
    out: dict[str, object] = {}

    def stream(prompt: str, **logprobs) -> tuple:
        """A streamed completion: (text, prompt ids, output ids, finish reason),
        then the tokens its logprobs name when ``logprobs`` asks for them."""
        chunks = [
            c.choices[0]
            for c in client.completions.create(prompt=prompt, stream=True, **greedy, **logprobs)
        ]
        named = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
        return (
            "".join(c.text for c in chunks),
            chunks[0].prompt_token_ids,
            [t for c in chunks for t in c.token_ids or []],
            chunks[-1].finish_reason,
        ) + ((named,) if logprobs else ())

    for i, prompt in enumerate(PROMPTS):
        r = client.completions.create(prompt=prompt, logprobs=0, **greedy)
        c = r.choices[0]
        out[f"completion {i}"] = (
            c.text,
            c.prompt_token_ids,
            c.token_ids,
            c.finish_reason,
            r.usage.completion_tokens,
            c.logprobs.tokens if c.logprobs else None,
        )
        out[f"completion {i}, streamed"] = stream(prompt, logprobs=0)

    r = client.chat.completions.create(messages=CHAT, logprobs=True, top_logprobs=0, **greedy)
    c = r.choices[0]
    named = [e.token for e in c.logprobs.content] if c.logprobs else None
    out["chat"] = (c.message.content, r.prompt_token_ids, c.token_ids, c.finish_reason, named)
    chunks = list(
        client.chat.completions.create(
            messages=CHAT, stream=True, logprobs=True, top_logprobs=0, **greedy
        )
    )
    choices = [ch.choices[0] for ch in chunks if ch.choices]
    out["chat, streamed"] = (
        "".join(c.delta.content or "" for c in choices),
        chunks[0].prompt_token_ids,
        [t for c in choices[1:] for t in c.token_ids or []],
        choices[-1].finish_reason,
        [e.token for c in choices if c.logprobs and c.logprobs.content for e in c.logprobs.content],
    )

    out["four prompts, one at a time"] = [stream(p) for p in CONCURRENT]
    with ThreadPoolExecutor(len(CONCURRENT)) as pool:
        out["four concurrent streams"] = list(pool.map(stream, CONCURRENT))

    choice = {"structured_outputs": {"choice": ["blue", "green", "red"]}, **IDS}
    r = client.chat.completions.create(messages=CHAT, **{**greedy, "extra_body": choice})
    out["chat constrained to a choice"] = (r.choices[0].message.content, r.choices[0].token_ids)

    metrics = httpx.get(url + "/metrics").text
    out["speculative decoding: drafts, draft tokens, accepted tokens"] = tuple(
        _gauge(metrics, name) for name in SPEC_COUNTERS
    )

    chunks = client.completions.create(
        model=model, prompt="Tell a long story. " * 20, max_tokens=200, temperature=0, stream=True
    )
    for n, _ in enumerate(chunks):
        if n == 2:
            break
    chunks.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 30
    while True:
        metrics = httpx.get(url + "/metrics").text
        state = (
            _gauge(metrics, "vllm:kv_cache_usage_perc"),
            _gauge(metrics, "vllm:num_requests_running"),
        )
        if state == (0.0, 0.0) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    out["after a disconnect: KV usage, running"] = state
    return out


def compare(reference: dict, student: dict) -> str | None:
    """The first difference, in one line; None when the transcripts agree.
    Besides entry by entry: each of the student's concurrent streams must be
    the reference's answer to the same request sent alone (greedy)."""
    for key, want in reference.items():
        got = student.get(key)
        if got != want:
            return f"{key}: the reference's engine gave {want!r}, yours gave {got!r}"
    alone = reference["four prompts, one at a time"]
    for prompt, want, got in zip(
        CONCURRENT, alone, student["four concurrent streams"], strict=True
    ):
        if got != want:
            return (
                f"{prompt!r} streamed beside three others: the reference's engine, asked "
                f"alone, gave {want!r}, yours gave {got!r}"
            )
    return None


def run_student(labs: Path, phases: list[str]) -> dict | str:
    """The transcript of the student's engine, or why it could not be had."""
    try:
        with serve(labs, phases) as url:
            return transcript(url)
    except EngineDidNotStart as e:
        return f"the engine did not start: {e}"
    except Exception as e:  # the server broke mid-run: a 500, a dropped stream
        return f"a request failed: {type(e).__name__}: {e}"


def grade(labs: Path, reference: dict, phases: list[str] | None = None) -> str | None:
    """None when the student's engine (``phases``; None: all, []: none, the
    reference) answers as the reference's; else the first difference, in one line."""
    got = run_student(labs, R.phases() if phases is None else phases)
    return got if isinstance(got, str) else compare(reference, got)


def bisect(labs: Path, reference: dict, why: str | None = None) -> str:
    """The first phase, in course order, whose code makes the run differ: the
    student's phases 00..k with the reference's after them, the smallest such
    k found by binary search (so it assumes that once a phase's code makes the
    run differ, adding later phases' code keeps it differing). ``why``: the
    whole engine's difference, when already known. One line."""
    phases = R.phases()
    lo, hi = 0, len(phases) - 1  # the student's phases[: hi + 1] are known to differ
    if why is None and (why := grade(labs, reference, phases)) is None:
        return "your engine answers as the reference's: no phase to name"
    while lo < hi:
        mid = (lo + hi) // 2
        if (differs := grade(labs, reference, phases[: mid + 1])) is not None:
            hi, why = mid, differs
        else:
            lo = mid + 1
    return (
        f"Phase {phases[hi]} is the first whose code makes your engine differ "
        f"(phases {phases[0]}..{phases[hi]} yours, the rest the reference's): {why}"
    )
