"""``python -m mini_vllm.oracle record [--only scheduler|kv_cache|kv_sizing] [--check] [--out DIR]``

Records everything the tests and graders compare against from the pinned
upstream: the scheduler scenarios in ``mini_vllm.oracle.scenarios`` (with
and without speculation) into
tests/snapshots/scheduler, the KV-cache scenarios in
``mini_vllm.oracle.kv_scenarios`` into tests/snapshots/kv_cache, and the
KV-cache sizing cases of ``mini_vllm.oracle.kv_sizing`` into
tests/snapshots/kv_sizing/upstream.json. ``--only`` records one kind;
``--out DIR`` (with ``--only``) writes to DIR instead. With ``--check`` nothing is
written: exits 1 if any committed snapshot differs from a fresh recording.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mini_vllm.oracle import kv_sizing, kv_snapshots, snapshots
from mini_vllm.oracle.kv_scenarios import KV_SCENARIOS
from mini_vllm.oracle.scenarios import SCENARIOS, SPEC_SCENARIOS

KINDS = {
    "scheduler": (snapshots, SCENARIOS + SPEC_SCENARIOS),
    "kv_cache": (kv_snapshots, KV_SCENARIOS),
}
# Kinds recorded into one file: {kind: (module with record() and dumps(), committed path)}.
SINGLE_FILE_KINDS = {"kv_sizing": (kv_sizing, kv_sizing.RECORDING)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mini_vllm.oracle")
    parser.add_argument("command", choices=["record"])
    parser.add_argument(
        "--only",
        choices=sorted([*KINDS, *SINGLE_FILE_KINDS]),
        default=None,
        help="record only these snapshots",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where to write (needs --only; default: the committed folder)",
    )
    parser.add_argument(
        "--check", action="store_true", help="compare with the committed files instead of writing"
    )
    args = parser.parse_args(argv)
    if args.out is not None and args.only is None:
        parser.error("--out needs --only (the kinds live in different folders)")
    stale = []
    for kind in [args.only] if args.only else [*KINDS, *SINGLE_FILE_KINDS]:
        if kind in SINGLE_FILE_KINDS:
            module, committed = SINGLE_FILE_KINDS[kind]
            out = args.out or committed.parent
            files = [(out / committed.name, lambda module=module: module.dumps(module.record()))]
        else:
            module, scenarios = KINDS[kind]
            out = args.out or module.SNAPSHOT_DIR
            files = [
                (out / f"{w.name}.json", lambda module=module, w=w: module.dumps(module.record(w)))
                for w in scenarios
            ]
        out.mkdir(parents=True, exist_ok=True)
        for path, make_text in files:
            text = make_text()
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
