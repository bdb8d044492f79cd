"""mini_vllm against traces recorded from the pinned upstream (no vllm needed).

Each file in tests/snapshots/scheduler was written by
``python -m mini_vllm.oracle record`` (``make snapshots``) from vllm 0.22.1.
A mismatch names the first step and field that differ.
"""

from __future__ import annotations

import pytest

import mini_vllm.testing as mini
from mini_vllm.oracle import snapshots
from mini_vllm.oracle.scenarios import SCENARIOS, SPEC_SCENARIOS
from mini_vllm.oracle.workload import first_difference, run_workload

FILES = sorted(snapshots.SNAPSHOT_DIR.glob("*.json"))


def test_every_scenario_has_a_snapshot():
    assert sorted(f.stem for f in FILES) == sorted(w.name for w in SCENARIOS + SPEC_SCENARIOS)


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_snapshot_header(path):
    workload, header, _ = snapshots.load(path)
    assert header["vllm_version"] == "0.22.1"
    assert header["vllm_commit"] == "0decac0d96c42b49572498019f0a0e3600f50398"
    assert header["recorder_version"] == snapshots.RECORDER_VERSION
    assert header["config"] == workload.config


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_mini_vllm_matches_upstream_snapshot(path):
    workload, _, expected = snapshots.load(path)
    diff = first_difference(expected, run_workload(mini, workload))
    assert diff is None, f"scenario {workload.name}: {diff}"


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_snapshot_is_the_scenario_in_code(path):
    """The committed workload is the one scenarios.py defines (else re-record)."""
    workload, _, _ = snapshots.load(path)
    in_code = next(w for w in SCENARIOS + SPEC_SCENARIOS if w.name == workload.name)
    assert workload.to_dict() == in_code.to_dict(), "scenario changed: run `make snapshots`"
