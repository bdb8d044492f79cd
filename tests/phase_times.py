"""Seconds per phase, printed at the end of a run: what each phase costs CI.

The per-phase work in CI is the honesty checks (tests/test_labs_honest.py:
the reference, the untouched starters and a solved copy, each a full
``check NN``) and the phase's notebook (``pytest --nbmake notebooks``). This
plugin adds up each test's setup, call and teardown by phase and prints a
table, so a new phase is tuned with its measured cost in hand. It prints
only: nothing is asserted on a time.

tests/conftest.py registers it for ``pytest``; the notebook run loads it
with ``-p tests.phase_times`` (Makefile).
"""

from __future__ import annotations

import re
from collections import defaultdict

HONESTY = re.compile(r"test_labs_honest\.py::test_(\w+?)_\w*\[(\d\d)\]$")
NOTEBOOK = re.compile(r"notebooks/phase-(\d\d)-[\w-]+\.ipynb")
# Column of each honesty check, by its test's first word.
CHECKS = {"reference": "reference", "untouched": "starters", "solved": "solved"}
COLUMNS = ["reference", "starters", "solved", "notebook"]


def phase_and_column(nodeid: str) -> tuple[str, str] | None:
    """("03", "solved") for a phase's honesty check or notebook; None otherwise."""
    if m := HONESTY.search(nodeid):
        column = CHECKS.get(m[1])
        return (m[2], column) if column else None
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
    shown = [c for c in COLUMNS if any(c in row for row in seconds.values())]
    terminalreporter.section("seconds per phase (honesty checks, notebook)")
    terminalreporter.write_line(f"{'phase':6}" + "".join(f"{c:>11}" for c in shown + ["total"]))
    for phase, row in sorted(seconds.items()):
        cells = "".join(f"{row[c]:>11.1f}" if c in row else f"{'-':>11}" for c in shown)
        terminalreporter.write_line(f"{phase:6}{cells}{sum(row.values()):>11.1f}")
    total = sum(sum(row.values()) for row in seconds.values())
    terminalreporter.write_line(f"{'all':6}{'':>{11 * len(shown)}}{total:>11.1f}")
