"""Record scenario traces from the pinned upstream, and load them back.

A snapshot is JSON: a header (vllm version and commit, recorder version,
the scheduler config), the workload, and upstream's trace. Tests compare
mini_vllm against snapshots without vllm installed; re-recording at the pin
must reproduce the committed files byte for byte.
"""

from __future__ import annotations

import json
from pathlib import Path

from mini_vllm.oracle.workload import Workload

# Bump when the trace format changes (then re-record with `make snapshots`).
RECORDER_VERSION = 1
SNAPSHOT_DIR = Path(__file__).resolve().parents[2] / "tests" / "snapshots" / "scheduler"


def record(workload: Workload) -> dict:
    """Run a workload through the pinned upstream (imports vllm)."""
    from mini_vllm.oracle import upstream
    from mini_vllm.oracle.workload import run_workload

    return {
        "header": {
            "vllm_version": upstream.VERSION,
            "vllm_commit": upstream.COMMIT,
            "recorder_version": RECORDER_VERSION,
            "config": workload.config,
        },
        "workload": workload.to_dict(),
        "trace": run_workload(upstream, workload),
    }


def dumps(snapshot: dict) -> str:
    return json.dumps(snapshot, indent=1, sort_keys=True) + "\n"


def load(path: Path) -> tuple[Workload, dict, dict]:
    """(workload, header, upstream trace) from a snapshot file."""
    data = json.loads(Path(path).read_text())
    return Workload.from_dict(data["workload"]), data["header"], data["trace"]
