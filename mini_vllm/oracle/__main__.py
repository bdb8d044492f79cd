"""``python -m mini_vllm.oracle record [--check] [--out DIR]``

Records every scenario in ``mini_vllm.oracle.scenarios`` from the pinned
upstream into DIR (default tests/snapshots/scheduler). With ``--check``
nothing is written: exits 1 if any committed snapshot differs from a fresh
recording.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mini_vllm.oracle import snapshots
from mini_vllm.oracle.scenarios import SCENARIOS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mini_vllm.oracle")
    parser.add_argument("command", choices=["record"])
    parser.add_argument("--out", type=Path, default=snapshots.SNAPSHOT_DIR)
    parser.add_argument("--check", action="store_true",
                        help="compare with the files in --out instead of writing")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    stale = []
    for workload in SCENARIOS:
        text = snapshots.dumps(snapshots.record(workload))
        path = args.out / f"{workload.name}.json"
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
            print(f"recorded {path}")
    if stale:
        print(f"snapshots differ from a fresh recording at the pin: {stale}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
