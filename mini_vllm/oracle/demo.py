"""``python -m mini_vllm.oracle.demo``: watch the scheduler work, step by step.

Runs one of the named scenarios (mini_vllm.oracle.scenarios) through
mini_vllm's Scheduler with a fake model and prints, for every step, how many
tokens each request got (P = prefill chunk, D = decode), who was preempted,
who finished, and how many KV blocks are free.
"""

from __future__ import annotations

import argparse
import sys

import mini_vllm.testing as mini
from mini_vllm.oracle.scenarios import SCENARIOS, get_scenario
from mini_vllm.oracle.workload import run_workload


def render(trace: dict) -> list[str]:
    lines = [f"{'step':>4}  {'free':>4}  scheduled (P=prefill chunk, D=decode)"]
    for i, step in enumerate(trace["steps"]):
        decoding = {r for r, *_ in step["cached"] if _[2] > 0}
        parts = [f"{r}:{'D' if r in decoding and n == 1 else 'P'}{n}" for r, n in step["scheduled"]]
        notes = []
        if step["preempted"]:
            notes.append(f"preempted {','.join(step['preempted'])}")
        done = [f"{r}({reason})" for r, _, reason, _ in step["outputs"] if reason]
        if done:
            notes.append(f"finished {','.join(done)}")
        lines.append(
            f"{i:>4}  {step['free_blocks']:>4}  {' '.join(parts) or '-':<40} {'; '.join(notes)}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mini_vllm.oracle.demo", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--scenario", default="preemption_fcfs", choices=[w.name for w in SCENARIOS]
    )
    args = parser.parse_args(argv)
    workload = get_scenario(args.scenario)
    print(f"scenario {workload.name}: {len(workload.requests)} requests, config {workload.config}")
    trace = run_workload(mini, workload)
    print("\n".join(render(trace)))
    outputs = sum(len(v["output_token_ids"]) for v in trace["final"].values())
    preemptions = sum(v["num_preemptions"] for v in trace["final"].values())
    print(f"{len(trace['steps'])} steps, {outputs} output tokens, {preemptions} preemptions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
