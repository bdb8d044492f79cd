"""Run a graded suite in a child pytest and keep its time limits whatever the code does.

``python -m mini_vllm.grading check`` calls ``grade``. The grading plugin
(plugin.py) fails a test that runs past its limit by raising an exception in
it; code that catches ``BaseException`` can swallow that, and Ctrl-C too.
So pytest runs in a child process that logs each test's start, hang and
result (``--grading-events``), and this module watches it:

- a test still running ``GRACE`` seconds past its limit (on clock.py's
  clock, which leaves out time spent waiting for a busy CPU) is stopped (SIGTERM,
  which dumps every thread's stack first; then SIGKILL). The test fails
  naming the function it was stuck in, its lab's other tests fail at once,
  and a new child grades the tests not yet run, so the other labs are still
  graded;
- Ctrl-C stops the child the same way and gives no score (exit 130);
- the score comes only from this run: the last child must write its
  results file, tagged with this run's id, or there is no score (a lab that
  ends the process with ``os._exit(0)`` cannot pass for a full mark);
- a run that selects no graded test says so and gives no score.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from mini_vllm.grading import impl as impl_mod
from mini_vllm.grading.clock import TestClock
from mini_vllm.grading.plugin import results_of
from mini_vllm.grading.regions import REPO_ROOT

# How long past its own limit a test may run before the child is stopped:
# the plugin's timeout fires at the limit, so this only matters for code that
# swallowed it (and for a hang while a test's fixtures load your code).
GRACE = 10.0
STOP_WAIT = 5.0  # after SIGTERM (or Ctrl-C), before SIGKILL
FRAME = re.compile(r'^\s*File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>\S+)')


@dataclass
class Outcome:
    results: dict | None  # None: no score (``problem`` says why)
    complete: bool = True  # False: a child had to be stopped
    hung: bool = False  # a test ran past its time limit
    interrupted: bool = False
    problem: str = ""


def grade(folder: Path, pytest_args: list[str]) -> Outcome:
    """Grade the suites under ``folder``: one child pytest, plus one more
    after each child stopped for ignoring a time limit."""
    run_id = uuid.uuid4().hex
    env = dict(os.environ, MINI_VLLM_RUN_ID=run_id)
    by_id: dict[str, dict] = {}
    complete = True
    part = 0
    with tempfile.TemporaryDirectory(prefix="mini_vllm-check-") as tmp:
        while True:  # each stopped child takes at least its stuck test with it
            part += 1
            events = Path(tmp) / f"events-{part}.jsonl"
            results = Path(tmp) / f"results-{part}.json"
            skip = Path(tmp) / f"skip-{part}.txt"
            skip.write_text("".join(f"{n}\n" for n, t in by_id.items() if t["status"] != "pending"))
            cmd = [
                sys.executable,
                "-m",
                "pytest",
                str(folder),
                "-p",
                "no:cacheprovider",
                "--tb=short",
                "-q",
                "--rootdir",
                str(REPO_ROOT),
                "--results",
                str(results),
                "--no-score-table",
                "--grading-events",
                str(events),
                "--grading-skip",
                str(skip),
                *pytest_args,
            ]
            child = subprocess.Popen(cmd, env=env)
            try:
                stuck = watch(child, events)
            except KeyboardInterrupt:
                stop(child, wait_first=True)
                running = current_test(events)
                where = stuck_in(Path(f"{events}.stacks"))
                return Outcome(
                    None,
                    interrupted=True,
                    problem="Interrupted"
                    + (f" during {running[0]}" if running else "")
                    + (f", in {where}" if where else "")
                    + ".",
                )
            merge(by_id, events)
            if stuck is None:
                return finish(by_id, results, run_id, child.returncode, complete, events)
            complete = False
            fail_stuck(by_id, stuck, Path(f"{events}.stacks"))
            if all(t["status"] != "pending" for t in by_id.values()):
                # Nothing left for a new child to run: this is the whole grade.
                return Outcome(results_of(by_id, run_id), complete=False, hung=True)


def watch(child: subprocess.Popen, events: Path) -> tuple[str, float, str] | None:
    """Wait for ``child``; None when it ended on its own. A test whose setup
    or body runs ``GRACE`` seconds past its limit stops it: returns what
    ``current_test`` said."""
    seen, clock = None, TestClock(child.pid)
    while child.poll() is None:
        running = current_test(events)
        if running != seen:
            seen = running
            clock.restart()
        if running and clock.elapsed() > running[1] + GRACE:
            stop(child)
            return running
        time.sleep(0.2)
    return None


def stop(child: subprocess.Popen, wait_first: bool = False) -> None:
    """SIGTERM (the plugin dumps the stacks), then SIGKILL; with ``wait_first``,
    first give the child a moment to end by itself (it got the Ctrl-C too)."""
    for sig in ((None,) if wait_first else ()) + (signal.SIGTERM, signal.SIGKILL):
        if sig is not None and child.poll() is None:
            child.send_signal(sig)
        try:
            child.wait(STOP_WAIT)
            return
        except subprocess.TimeoutExpired:
            continue
        except KeyboardInterrupt:  # a second Ctrl-C: stop at once
            continue


def read_events(events: Path) -> list[dict]:
    if not events.exists():
        return []
    lines = events.read_text().splitlines()
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:  # a line still being written
            break
    return out


def current_test(events: Path) -> tuple[str, float, str] | None:
    """(node id, time limit, "setup" or "call") of the test running now, or
    None. Its setup and its body each get the limit, as in the plugin."""
    running = None
    for e in read_events(events):
        if e["event"] in ("setup", "call"):
            running = (e["nodeid"], e["limit"], e["event"])
        elif e["event"] == "result" and running and e["nodeid"] == running[0]:
            running = None
    return running


def merge(by_id: dict, events: Path) -> None:
    """Fold one child's log into ``by_id``: the tests it registered and
    the results it finished."""
    for e in read_events(events):
        if e["event"] == "collected":
            for nodeid, entry in e["tests"].items():
                by_id.setdefault(nodeid, entry)
        elif e["event"] == "result":
            by_id[e["nodeid"]].update(status=e["status"], output=e["output"])
        elif e["event"] == "hung" and e["nodeid"] in by_id:
            by_id[e["nodeid"]]["hung"] = e["output"]


def stuck_in(stacks: Path) -> str | None:
    """The innermost frame of the project's or the student's code in the
    stopped child's main thread, from the stacks the interpreter dumped."""
    if not stacks.exists():
        return None
    blocks = stacks.read_text().split("\n\n")
    main = [b for b in blocks if b.lstrip().startswith("Current thread")] or blocks[-1:]
    ours = (str(REPO_ROOT), str(impl_mod.labs_dir()))
    for line in main[0].splitlines():  # most recent call first
        m = FRAME.match(line)
        if m and m["file"].startswith(ours) and "/.venv/" not in m["file"]:
            return f"`{m['func']}` ({m['file']}:{m['line']})"
    return None


def fail_stuck(by_id: dict, stuck: tuple[str, float, str], stacks: Path) -> None:
    """The stopped test fails naming where it was stuck; its lab's other
    tests, and the phase's whole-phase tests, fail at once."""
    nodeid, limit, stage = stuck
    where = stuck_in(stacks) or "code that could not be located"
    entry = by_id[nodeid]
    entry["status"] = "failed"
    entry["output"] = (
        f"{stage}: still running {limit + GRACE:g} s after it started (its limit is {limit:g} s), "
        f"stuck in {where}, so the run was stopped. The code kept running after the time "
        "limit: does a loop catch BaseException (or use a bare `except:`)? Catch Exception "
        "instead, and look for a loop that never ends."
    )
    lab = entry["lab"]
    phase = lab.split(".")[0]
    for t in by_id.values():
        if t["status"] != "pending":
            continue
        if t["lab"] == lab or (t.get("whole_phase") and t["lab"].split(".")[0] == phase):
            t["status"] = "failed"
            t["output"] = f"not run: {nodeid} was stopped, stuck in {where}."


def finish(
    by_id: dict, results: Path, run_id: str, returncode: int, complete: bool, events: Path
) -> Outcome:
    """The outcome once the last child ended on its own."""
    if returncode == 2:  # pytest's "interrupted"
        return Outcome(None, interrupted=True, problem="Interrupted: the run did not finish.")
    if not by_id:
        return Outcome(
            None,
            problem=(
                f"No graded test was selected (pytest exit code {returncode}): check the "
                "target and any -k or node ids given after --."
            ),
        )
    try:
        written = json.loads(results.read_text())
    except (OSError, ValueError):
        written = None
    if written is None or written.get("run_id") != run_id:
        last = current_test(events)
        return Outcome(
            None,
            problem=(
                f"The test run ended (exit code {returncode}) without writing this run's "
                "results"
                + (f", during {last[0]}" if last else "")
                + ": something ended the process early (os._exit() or sys.exit() in the "
                "code under grade, or at its import?)."
            ),
        )
    for entry in by_id.values():
        if entry.get("hung") and entry["status"] != "failed":
            entry.update(status="failed", output=f"call: {entry['hung']}")
    hung = not complete or any(entry.get("hung") for entry in by_id.values())
    return Outcome(results_of(by_id, run_id), complete=complete and returncode in (0, 1), hung=hung)
