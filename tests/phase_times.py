"""Seconds per phase, printed at the end of a run against each phase's budget.

The per-phase work in CI is the honesty checks (tests/test_labs_honest.py:
the reference, the untouched starters and the solved copy, each a
``check NN`` or a part of one; Lab 19.3's served runs in
tests/test_capstone.py), the runnable examples of the phase's docs
(tests/upstream/test_phase_docs.py) and the phase's notebook. This plugin
adds up each of those tests' setup, call and teardown by phase and prints a
table with the budget beside the total, so a new phase is tuned with its
measured cost in hand. It prints only: nothing is asserted on a time.

The seconds are test time, summed over pytest-xdist's workers: with two
workers busy, the wall clock is about half of the sum.

BUDGET_S is what one phase may cost in ``make test`` (the fast tier): twenty
phases at this budget, the phase-independent tests and the installs keep a
fresh-clone ``make test`` under 35 minutes on a 2-core machine (tests/README.md,
"Two tiers", gives the arithmetic).

tests/conftest.py registers it for ``pytest``; a notebook-only run loads it
with ``-p tests.phase_times`` (Makefile).
"""

from __future__ import annotations

import re
from collections import defaultdict

from mini_vllm.tiers import tier

HONESTY = re.compile(r"test_labs_honest\.py::test_(\w+?)_\w*\[(\d\d)(?:\.\d+)?\]$")
DOC_EXAMPLE = re.compile(r"test_phase_docs\.py::test_examples_\w+\[phases/(\d\d)-")
NOTEBOOK = re.compile(r"notebooks/phase-(\d\d)-[\w-]+\.ipynb")
# Lab 19.3's served runs are proven in their own file (PROVEN_ELSEWHERE in
# tests/test_labs_honest.py); the reference server starts in the first one's setup.
CAPSTONE = re.compile(r"test_capstone\.py::test_(solved|untouched)_\w+$")
# Column of each honesty check, by its test's first word.
CHECKS = {"reference": "reference", "untouched": "starters", "solved": "solved"}
COLUMNS = ["reference", "starters", "solved", "docs", "notebook"]
BUDGET_S = {"fast": 120.0, "deep": 600.0}


def phase_and_column(nodeid: str) -> tuple[str, str] | None:
    """("03", "solved") for a phase's honesty check, doc example or notebook;
    None otherwise."""
    if m := HONESTY.search(nodeid):
        column = CHECKS.get(m[1])
        return (m[2], column) if column else None
    if m := CAPSTONE.search(nodeid):
        return "19", CHECKS[m[1]]
    if m := DOC_EXAMPLE.search(nodeid):
        return m[1], "docs"
    if m := NOTEBOOK.search(nodeid):
        return m[1], "notebook"
    return None


# {phase: {column: seconds}} of this run (one pytest process).
seconds: defaultdict[str, defaultdict[str, float]] = defaultdict(lambda: defaultdict(float))


def pytest_runtest_logreport(report):
    key = phase_and_column(report.nodeid)
    if key is not None:
        seconds[key[0]][key[1]] += report.duration


def pytest_terminal_summary(terminalreporter):
    if not seconds:
        return
    budget = BUDGET_S[tier()]
    shown = [c for c in COLUMNS if any(c in row for row in seconds.values())]
    terminalreporter.section(f"seconds per phase ({tier()} tier; budget {budget:.0f} s a phase)")
    terminalreporter.write_line(
        f"{'phase':6}" + "".join(f"{c:>10}" for c in shown + ["total"]) + "  budget"
    )
    for phase, row in sorted(seconds.items()):
        cells = "".join(f"{row[c]:>10.1f}" if c in row else f"{'-':>10}" for c in shown)
        total = sum(row.values())
        verdict = "ok" if total <= budget else f"OVER by {total - budget:.0f} s"
        terminalreporter.write_line(f"{phase:6}{cells}{total:>10.1f}  {verdict}")
    total = sum(sum(row.values()) for row in seconds.values())
    terminalreporter.write_line(f"{'all':6}{'':>{10 * len(shown)}}{total:>10.1f}")
