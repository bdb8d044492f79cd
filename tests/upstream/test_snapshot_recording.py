"""Re-recording every scenario at the pin reproduces the committed snapshots."""

from __future__ import annotations

import pytest

from mini_vllm.oracle import snapshots
from mini_vllm.oracle.scenarios import SCENARIOS, SPEC_SCENARIOS

pytestmark = pytest.mark.upstream


ALL = SCENARIOS + SPEC_SCENARIOS


@pytest.mark.parametrize("workload", ALL, ids=[w.name for w in ALL])
def test_rerecording_at_the_pin_changes_nothing(workload):
    path = snapshots.SNAPSHOT_DIR / f"{workload.name}.json"
    assert path.exists(), f"{path.name} missing: run `make snapshots`"
    assert snapshots.dumps(snapshots.record(workload)) == path.read_text(), (
        f"{path.name} differs from a fresh recording at the pin: run `make snapshots` "
        "and review the diff"
    )
