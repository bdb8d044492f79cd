"""Helpers of Phase 16's graded suites: engine settings, unwritten regions, chunk diffs."""

from __future__ import annotations

import json
import time

import pytest

MODEL = "tiny-llama"
# Small and quick: 128 tokens of context, 64 KV blocks of 16 tokens.
ENGINE_ARGS = dict(max_model_len=128, num_gpu_blocks_override=64, device="cpu", max_num_seqs=32)


def call(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``; an unwritten region fails the test, saying so."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as e:
        pytest.fail(f"{e}: a lab region is not written yet.", pytrace=False)


def unwritten(chunks: list[str], lab: str) -> None:
    """Fail if a stream carries an unwritten region's NotImplementedError (the
    stream generator turns any exception into an error event)."""
    for chunk in chunks:
        if f"Lab {lab}" in chunk:
            message = json.loads(chunk[len("data: ") :])["error"]["message"]
            pytest.fail(f"{message}: a lab region is not written yet.", pytrace=False)


def chunk_difference(want: list[str], got: list[str], labels=("upstream", "yours")) -> str | None:
    """None if the two streams are equal, else the first event that differs, in words."""
    if want == got:
        return None
    for k, (a, b) in enumerate(zip(want, got, strict=False)):
        if a != b:
            return f"event {k} differs:\n  {labels[0]}: {a!r}\n  {labels[1]}: {b!r}"
    shorter, longer = (labels[1], want) if len(got) < len(want) else (labels[0], got)
    k = min(len(want), len(got))
    return (
        f"{labels[0]} sent {len(want)} events, {labels[1]} {len(got)}; {shorter} has no "
        f"event {k}, which is {longer[k]!r}"
    )


def num_free_blocks(engine) -> int:
    return engine.llm_engine.engine_core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def all_blocks_free(engine) -> bool:
    """Every KV block but the null block is free."""
    return num_free_blocks(engine) == engine.vllm_config.cache_config.num_gpu_blocks - 1


def wait_until_idle(engine, timeout: float = 20.0) -> list[str]:
    """Wait until the engine core holds no request; the ids still held after
    ``timeout`` seconds (empty when it went idle)."""
    scheduler = engine.llm_engine.engine_core.scheduler
    deadline = time.monotonic() + timeout
    while scheduler.requests or scheduler.finished_req_ids:
        if time.monotonic() > deadline:
            return list(scheduler.requests)
        time.sleep(0.02)
    return []
