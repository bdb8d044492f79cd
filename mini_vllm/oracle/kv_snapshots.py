"""Record KV-cache workload traces from the pinned upstream, and load them back.

The KV-cache twin of ``snapshots.py``: a snapshot is JSON holding a header
(vllm version and commit, recorder version, the manager config), the
workload (``kv_scenarios.py``) and upstream's trace, one record per
operation (``kv_workload.py``). Tests and the Phase 02 graders compare
against these files without vllm installed; re-recording at the pin must
reproduce them byte for byte.
"""

from __future__ import annotations

import json
from pathlib import Path

from mini_vllm.oracle.kv_workload import KVWorkload

# Bump when the trace format changes (then re-record with `make snapshots`).
RECORDER_VERSION = 1
SNAPSHOT_DIR = Path(__file__).resolve().parents[2] / "tests" / "snapshots" / "kv_cache"


def record(workload: KVWorkload) -> dict:
    """Run a workload through the pinned upstream's KVCacheManager (imports vllm)."""
    from mini_vllm.oracle import upstream
    from mini_vllm.oracle.kv_workload import run_kv_workload

    return {
        "header": {
            "vllm_version": upstream.VERSION,
            "vllm_commit": upstream.COMMIT,
            "recorder_version": RECORDER_VERSION,
            "config": workload.config,
        },
        "workload": workload.to_dict(),
        "trace": run_kv_workload(upstream, workload),
    }


def dumps(snapshot: dict) -> str:
    return json.dumps(snapshot, indent=1, sort_keys=True) + "\n"


def load(path: Path) -> tuple[KVWorkload, dict, dict]:
    """(workload, header, upstream trace) from a snapshot file."""
    data = json.loads(Path(path).read_text())
    return KVWorkload.from_dict(data["workload"]), data["header"], data["trace"]


def path_of(name: str) -> Path:
    return SNAPSHOT_DIR / f"{name}.json"
