"""Re-recording every KV-cache scenario at the pin reproduces the committed snapshots."""

from __future__ import annotations

import pytest

from mini_vllm.oracle import kv_snapshots
from mini_vllm.oracle.kv_scenarios import KV_SCENARIOS

pytestmark = pytest.mark.upstream


@pytest.mark.parametrize("workload", KV_SCENARIOS, ids=[w.name for w in KV_SCENARIOS])
def test_rerecording_kv_snapshots_at_the_pin_changes_nothing(workload):
    path = kv_snapshots.path_of(workload.name)
    assert path.exists(), f"{path.name} missing: run `make snapshots`"
    assert kv_snapshots.dumps(kv_snapshots.record(workload)) == path.read_text(), (
        f"{path.name} differs from a fresh recording at the pin: run `make snapshots` "
        "and review the diff"
    )
