"""``python -m mini_vllm.oracle record [--only scheduler|kv_cache] [--check] [--out DIR]``

Records every scenario from the pinned upstream: the scheduler scenarios in
``mini_vllm.oracle.scenarios`` into tests/snapshots/scheduler, and the
KV-cache scenarios in ``mini_vllm.oracle.kv_scenarios`` into
tests/snapshots/kv_cache. ``--only`` records one of the two; ``--out DIR``
(with ``--only``) writes to DIR instead. With ``--check`` nothing is
written: exits 1 if any committed snapshot differs from a fresh recording.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mini_vllm.oracle import kv_snapshots, snapshots
from mini_vllm.oracle.kv_scenarios import KV_SCENARIOS
from mini_vllm.oracle.scenarios import SCENARIOS

KINDS = {
    "scheduler": (snapshots, SCENARIOS),
    "kv_cache": (kv_snapshots, KV_SCENARIOS),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mini_vllm.oracle")
    parser.add_argument("command", choices=["record"])
    parser.add_argument("--only", choices=sorted(KINDS), default=None,
                        help="record only these snapshots")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write (needs --only; default: the committed folder)")
    parser.add_argument("--check", action="store_true",
                        help="compare with the committed files instead of writing")
    args = parser.parse_args(argv)
    if args.out is not None and args.only is None:
        parser.error("--out needs --only (the two kinds live in different folders)")
    stale = []
    for kind in [args.only] if args.only else list(KINDS):
        module, scenarios = KINDS[kind]
        out = args.out or module.SNAPSHOT_DIR
        out.mkdir(parents=True, exist_ok=True)
        for workload in scenarios:
            text = module.dumps(module.record(workload))
            path = out / f"{workload.name}.json"
            if args.check:
                if not path.exists() or path.read_text() != text:
                    stale.append(f"{kind}/{path.name}")
            else:
                path.write_text(text)
                print(f"recorded {path}")
    if stale:
        print(f"snapshots differ from a fresh recording at the pin: {stale}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
