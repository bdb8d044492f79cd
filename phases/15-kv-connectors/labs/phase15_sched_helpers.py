"""Helpers for Labs 15.1 and 15.2: your Scheduler with the fake connector,
driven by hand, and the lockstep with upstream's.

The fake connector (mini_vllm/oracle/fake_connector.py) follows a plan per
request id: ``hit`` prompt tokens in its store, loaded synchronously or
(``async``) between steps, ``unknown`` "ask again" answers first, ``delay``
steps until an asynchronous load ends, ``fail`` the loaded blocks that fail,
``save`` steps a save holds the blocks after the request finishes. It
records every call with its arguments and what it returned
(``connector.take_calls()``). ``FakeWorker`` plays the workers: it reads
each step's connector metadata and reports, in the step they are due, the
loads and saves that ended and the blocks that failed.

(Imported by name from the suites: this folder is on sys.path because pytest
puts the folder of ``conftest.py`` there.)
"""

from __future__ import annotations

import pytest

import mini_vllm.testing as mini
from mini_vllm.grading.checks import written
from mini_vllm.oracle.connector_workload import (
    CONNECTOR_FIELD_WORDS,
    connector_config,
    run_connector_workload,
)
from mini_vllm.oracle.fake_connector import FakeWorker
from mini_vllm.oracle.workload import Workload, first_difference

BLOCK = 4
SMALL = dict(block_size=BLOCK, num_blocks=64, max_num_batched_tokens=64, max_model_len=64)
# What the fake model samples for every request that finished its prompt.
TOKEN = 1234


def make(impl, plan: dict, policy: str = "recompute", **config):
    """Your Scheduler over a small KV cache with the fake connector following
    ``plan``; ``config`` overrides SMALL."""
    workload = Workload(
        "by-hand",
        {**SMALL, **config, "kv_connector_plan": plan, "kv_load_failure_policy": policy},
        [],
    )
    sched = written(
        mini.create_scheduler,
        scheduler_cls=impl.scheduler.Scheduler,
        **connector_config(mini, workload),
    )
    sched.worker = FakeWorker()
    return sched


def add(sched, req_id: str, prompt: list[int], max_tokens: int = 3):
    (req,) = mini.create_requests(
        1,
        req_ids=[req_id],
        prompt_token_ids=[prompt],
        max_tokens=max_tokens,
        ignore_eos=True,
        block_size=BLOCK,
    )
    written(sched.add_request, req)
    return req


def prompt(first: int, n: int) -> list[int]:
    return list(range(first, first + n))


def free_blocks(sched) -> int:
    return sched.kv_cache_manager.block_pool.get_num_free_blocks()


def step(sched, n: int):
    """schedule(), the fake workers' report, update_from_output() with TOKEN
    for each request whose prompt is done. Returns (SchedulerOutput,
    EngineCoreOutputs, the report (sending, recving, failed blocks), the
    connector calls of the step)."""
    try:
        out = written(sched.schedule)
    except (AssertionError, RuntimeError, IndexError, AttributeError, KeyError) as e:
        pytest.fail(
            f"step {n}: schedule() raised {type(e).__name__}: {e}; statuses "
            f"{ {r: q.status.name for r, q in sched.requests.items()} }.",
            pytrace=False,
        )
    sending, recving, invalid = sched.worker.step(n, out.kv_connector_metadata)
    kv_output = mini.KVConnectorOutput(
        finished_sending=sending or None,
        finished_recving=recving or None,
        invalid_block_ids=invalid,
    )
    req_ids = list(out.num_scheduled_tokens)
    sampled = [
        [] if sched.requests[r].num_computed_tokens < sched.requests[r].num_tokens else [TOKEN]
        for r in req_ids
    ]
    result = written(
        sched.update_from_output,
        out,
        mini.ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_output,
        ),
    )
    return out, result, (sending, recving, invalid), sched.connector.take_calls()


def calls_named(calls: list[list], name: str) -> list[list]:
    return [c for c in calls if c[0] == name]


def lockstep(impl, up, workload: Workload) -> tuple[dict, str | None]:
    """(upstream's trace, the first difference with yours or None)."""
    # Yours first: an unwritten region fails before upstream's run is paid for.
    got = written(run_connector_workload, mini, workload, impl.scheduler.Scheduler)
    expected = run_connector_workload(up, workload)
    diff = first_difference(
        expected, got, labels=("upstream", "yours"), field_words=CONNECTOR_FIELD_WORDS
    )
    if diff is None and expected["leftover_calls"] != got["leftover_calls"]:
        diff = (
            f"after the last step the connector calls differ: upstream "
            f"{expected['leftover_calls']}, yours {got['leftover_calls']}"
        )
    return expected, diff


def describe(workload: Workload) -> str:
    plan = workload.config["kv_connector_plan"]
    return (
        f"config: { {k: v for k, v in workload.config.items() if k != 'kv_connector_plan'} }\n"
        "requests (id, prompt length, arrival step, max_tokens, connector plan): "
        + str(
            [
                (s.req_id, len(s.prompt_token_ids), s.arrive_step, s.max_tokens, plan.get(s.req_id))
                for s in workload.requests
            ]
        )
    )
