"""Hypothesis strategies for the scheduler lockstep with a KV connector.

A workload of ``strategies.workloads()`` (configs, prefixes, arrivals,
stops, aborts, preemption) plus a plan for the fake connector
(``mini_vllm/oracle/fake_connector.py``): most requests find some of their
prompt in the fake store, loaded synchronously or asynchronously, some
after "ask again" answers, some with a block that fails, some with a save
that holds their blocks for a few steps after they finish; and upstream's
two ``kv_load_failure_policy`` values.
"""

from __future__ import annotations

from hypothesis import strategies as st

from mini_vllm.kv_cache_interface import cdiv
from mini_vllm.oracle.strategies import workloads
from mini_vllm.oracle.workload import Workload


@st.composite
def connector_plans(draw, prompt_len: int) -> dict:
    return {
        # Up to the whole prompt (an async load may bring all of it).
        "hit": draw(st.integers(0, prompt_len) | st.just(prompt_len)),
        "async": draw(st.booleans()),
        "unknown": draw(st.sampled_from([0, 0, 0, 1, 2])),
        "delay": draw(st.sampled_from([0, 1, 1, 2, 3])),
        "fail": draw(st.none() | st.none() | st.lists(st.integers(0, 8), min_size=1, max_size=3)),
        "save": draw(st.none() | st.sampled_from([0, 1, 2, 3])),
    }


@st.composite
def connector_workloads(draw) -> Workload:
    workload = draw(workloads())
    config = workload.config
    if draw(st.booleans()):
        # A tight pool: one max_model_len request and a few blocks more, so
        # that loads and saves meet preemption (widened below for async loads).
        min_blocks = cdiv(config["max_model_len"], config["block_size"]) + 1
        config["num_blocks"] = min_blocks + draw(st.integers(0, 3))
    plan = {}
    for spec in workload.requests:
        if draw(st.integers(0, 4)) > 0:
            plan[spec.req_id] = draw(connector_plans(len(spec.prompt_token_ids)))
    # A request waiting for its KV holds its blocks and cannot be preempted:
    # with a pool that fits only one max_model_len request, upstream's
    # scheduler can preempt a running request forever while a load holds the
    # rest. The pool also fits every asynchronous load at once.
    held = sum(
        cdiv(len(spec.prompt_token_ids), config["block_size"])
        for spec in workload.requests
        if plan.get(spec.req_id, {}).get("async")
    )
    min_blocks = cdiv(config["max_model_len"], config["block_size"]) + 1
    config["num_blocks"] = max(config["num_blocks"], min_blocks + held)
    workload.config["kv_connector_plan"] = plan
    # Every generated workload ends in a few hundred steps; fail fast if not.
    workload.max_steps = 3000
    workload.config["kv_load_failure_policy"] = draw(st.sampled_from(["recompute", "fail"]))
    workload.name = f"connector-{workload.name}"
    return workload
