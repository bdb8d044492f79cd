"""mini_vllm's KV cache against traces recorded from the pinned upstream (no vllm needed).

Each file in tests/snapshots/kv_cache was written by
``python -m mini_vllm.oracle record`` (``make snapshots``) from vllm 0.22.1's
KVCacheManager. A mismatch names the first operation and field that differ.
"""

from __future__ import annotations

import pytest

import mini_vllm.testing as mini
from mini_vllm.oracle import kv_snapshots
from mini_vllm.oracle.kv_scenarios import KV_SCENARIOS
from mini_vllm.oracle.kv_workload import describe_op, first_kv_difference, run_kv_workload

FILES = sorted(kv_snapshots.SNAPSHOT_DIR.glob("*.json"))


def test_every_kv_scenario_has_a_snapshot():
    assert sorted(f.stem for f in FILES) == sorted(w.name for w in KV_SCENARIOS)


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_kv_snapshot_header(path):
    workload, header, _ = kv_snapshots.load(path)
    assert header["vllm_version"] == "0.22.1"
    assert header["vllm_commit"] == "0decac0d96c42b49572498019f0a0e3600f50398"
    assert header["recorder_version"] == kv_snapshots.RECORDER_VERSION
    assert header["config"] == workload.config


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_mini_vllm_matches_upstream_kv_snapshot(path):
    workload, _, expected = kv_snapshots.load(path)
    diff = first_kv_difference(expected, run_kv_workload(mini, workload))
    assert diff is None, f"scenario {workload.name}: {diff}"


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_kv_snapshot_is_the_scenario_in_code(path):
    """The committed workload is the one kv_scenarios.py defines (else re-record)."""
    workload, _, _ = kv_snapshots.load(path)
    in_code = next(w for w in KV_SCENARIOS if w.name == workload.name)
    assert workload.to_dict() == in_code.to_dict(), "scenario changed: run `make snapshots`"


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_kv_scenario_uses_the_manager_as_a_scheduler_would(path):
    """Upstream records whatever it is fed; these checks keep the scenarios
    meaningful: no slots for tokens that do not exist, lookups only for
    requests that hold no blocks, and every lookup followed by its request's
    allocate before anything can evict the hits."""
    workload, _, trace = kv_snapshots.load(path)
    for record in trace["ops"]:
        op = record["op"]
        if op[0] == "lookup":
            assert op[1] not in record["tables"], f"{describe_op(op)} while {op[1]} holds blocks"
    for req_id, final in trace["final"].items():
        assert final["num_computed_tokens"] <= final["num_tokens"], (req_id, final)
    for i, record in enumerate(trace["ops"]):
        if record["op"][0] != "lookup" or record["result"][1] == 0:
            continue
        later = [
            (j, r["op"])
            for j, r in enumerate(trace["ops"][i + 1 :], i + 1)
            if len(r["op"]) > 1 and r["op"][1] == record["op"][1]
        ]
        if later and later[0][1][0] == "allocate":
            assert later[0][0] == i + 1, f"op {i}: hits used {later[0][0] - i} ops later"


def test_the_scenarios_cover_the_phase_02_rules():
    """Each rule a Phase 02 lab grades shows up in at least one recording."""
    traces = {p.stem: kv_snapshots.load(p)[2] for p in FILES}
    ops = [r for t in traces.values() for r in t["ops"]]
    assert any(r["op"][0] == "allocate" and r["result"] is None for r in ops), (
        "no failed allocation"
    )
    assert any(r["op"][0] == "lookup" and r["result"][1] > 0 for r in ops), "no prefix hit"
    assert any(r["result"] is False for r in ops if r["op"][0] == "reset_prefix_cache")
    assert any(
        len(r["op"]) > 3 and r["op"][3].get("must_fit") and r["result"] is None for r in ops
    ), "the full-sequence gate never refuses"
    assert any(len(r["op"]) > 3 and r["op"][3].get("lookahead") for r in ops), "no lookahead"
    assert any(r["op"][0] == "preempt" for r in ops), "no preemption"
    assert any(max(r["ref_cnts"]) > 1 for r in ops), "no block is ever shared"
    # A hit that mixes two requests' copies of a prefix (duplicate hashes).
    dup = traces["duplicate_hashes"]["ops"]
    assert [1, 5] in [r["result"][0] for r in dup if r["op"][0] == "lookup"]
