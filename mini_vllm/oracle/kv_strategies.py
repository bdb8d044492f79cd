"""Hypothesis strategies for KV-cache workloads (``kv_workload.py``).

Shared by the live KV lockstep test against upstream (tests/upstream/) and
the Phase 02 graders, which run a student's KV cache against the reference
on the same generated workloads.

A workload is only meaningful if it uses the manager the way the scheduler
does: look a request up only while it holds no blocks, never ask for slots
for tokens that do not exist, let a request sample only once its tokens
are all computed. So the generator runs every operation it draws on the
reference manager before drawing the next, and chooses among the moves the
request's state allows: admit (lookup, then allocate a chunk), continue a
prefill, decode (sample one token, make room for it), finish, preempt, or
reset the prefix cache. The reference equals upstream on these workloads
(tests/upstream/test_kv_lockstep.py), so the same rules hold for upstream.
"""

from __future__ import annotations

from hypothesis import strategies as st

import mini_vllm.testing as mini
from mini_vllm.kv_cache_interface import cdiv
from mini_vllm.oracle.kv_workload import KVDriver, KVWorkload


@st.composite
def kv_groups(draw, block_size: int) -> list:
    """KV-cache groups of a hybrid model: ``None`` is a full-attention group,
    an int a sliding window. Full + one window (the common hybrid, one round
    of the hit search), one window alone (the unitary coordinator), two
    windows with or without full attention (the fixed point across kinds)."""
    window = st.integers(1, 4 * block_size + 1)
    shape = draw(st.sampled_from(["full+window", "full+window", "window", "two windows", "all"]))
    w1 = draw(window, label="window")
    if shape == "window":
        return [w1]
    if shape == "full+window":
        return draw(st.permutations([None, w1]), label="group order")
    w2 = draw(window.filter(lambda w: w != w1), label="second window")
    return [w1, w2] if shape == "two windows" else [None, w1, w2]


@st.composite
def kv_configs(draw, hybrid: bool = False) -> dict:
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    max_model_len = draw(st.integers(4, 128))
    # From "one max_model_len request barely fits" to roomy, weighted
    # toward tight pools so that allocations fail and blocks get evicted.
    low = cdiv(max_model_len, block_size) + 1
    num_blocks = draw(st.integers(low, low + 2) | st.integers(low, 3 * low) | st.integers(2, low))
    config = {
        "block_size": block_size,
        "num_blocks": num_blocks,
        "max_model_len": max_model_len,
        "enable_caching": draw(st.sampled_from([True, True, True, False])),
    }
    if hybrid:
        groups = draw(kv_groups(block_size))
        config["groups"] = groups
        # Every group takes blocks from the one pool: up to one more pool's
        # worth per extra group, often less, so that allocations still fail.
        extra = draw(st.integers(0, (len(groups) - 1) * (num_blocks - 1)), label="extra blocks")
        config["num_blocks"] = num_blocks + extra
    return config


@st.composite
def kv_workloads(draw, max_ops: int = 60, hybrid: bool = False) -> KVWorkload:
    """``hybrid``: configs with KV-cache groups (``kv_groups``)."""
    config = draw(kv_configs(hybrid=hybrid))
    bs, mml = config["block_size"], config["max_model_len"]
    prefixes = draw(
        st.lists(
            st.lists(st.integers(1, 50), min_size=bs, max_size=4 * bs + 3), min_size=1, max_size=3
        ),
        label="shared prefixes",
    )
    requests = []
    for i in range(draw(st.integers(1, 8), label="number of requests")):
        prefix = draw(st.sampled_from(prefixes)) if draw(st.booleans()) else []
        # Few distinct token values, so that equal blocks happen often.
        suffix = draw(st.lists(st.integers(1, 6), max_size=3 * bs + 2))
        prompt = (prefix + suffix)[: mml - 1] or [draw(st.integers(1, 6))]
        requests.append([f"r{i}", prompt])

    driver = KVDriver(mini, config, requests)
    mgr = driver.manager
    ops: list[list] = []

    def run(op: list) -> dict:
        ops.append(op)
        return driver.apply(op)

    finished: set[str] = set()
    for _ in range(draw(st.integers(1, max_ops), label="number of moves")):
        live = [r for r, _ in requests if r not in finished]
        if not live:
            break
        req_id = draw(st.sampled_from(live), label="request")
        request = driver.requests[req_id]
        holds = any(mgr.get_blocks(req_id).blocks)
        left = request.num_tokens - request.num_computed_tokens
        move = draw(
            st.sampled_from(["step", "step", "step", "step", "free", "preempt", "reset"]),
            label="move",
        )
        if move == "reset":
            run(["reset_prefix_cache"])
        elif move in ("free", "preempt"):
            run([move, req_id])
            if move == "free":
                finished.add(req_id)
        elif not holds and request.num_computed_tokens == 0:
            hit = run(["lookup", req_id])["result"][1]
            n = draw(st.integers(1, request.num_tokens - hit), label="prefill chunk")
            opts = {}
            if draw(st.booleans(), label="must fit"):
                opts["must_fit"] = True
            run(["allocate", req_id, n, opts] if opts else ["allocate", req_id, n])
        elif left > 0:
            run(["allocate", req_id, draw(st.integers(1, left), label="prefill chunk")])
        elif request.num_tokens < mml:
            run(["append", req_id, 1])
            lookahead = draw(st.sampled_from([0, 0, 0, 1, 3]), label="lookahead")
            run(
                ["allocate", req_id, 1, {"lookahead": lookahead}]
                if lookahead
                else ["allocate", req_id, 1]
            )
        else:
            run(["free", req_id])
            finished.add(req_id)
    return KVWorkload(name="generated", config=config, requests=requests, ops=ops)
