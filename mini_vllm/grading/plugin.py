"""The pytest plugin behind ``make check-phase-NN``: points, timeouts, scores.

Graded tests live in ``phases/NN-slug/labs/lab-MM-slug/``; the folder names
the lab (``NN.M``). A test is worth ``@pytest.mark.points(n)`` points (1 if
unmarked) and gets ``@pytest.mark.timeout(seconds)`` (``DEFAULT_TIMEOUT``
if unmarked) before it is failed as a likely infinite loop. At the end the
plugin prints a score table and writes a Gradescope-style ``results.json``.
The ``impl`` fixture hands a test the code under grade (see ``impl.py``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from collections import defaultdict
from pathlib import Path

import pytest

from mini_vllm.grading import impl as impl_mod

DEFAULT_TIMEOUT = 60.0
LAB_DIR = re.compile(r"^lab-(\d+)-[\w-]+$")
PHASE_DIR = re.compile(r"^(\d\d)-[\w-]+$")

__all__ = [
    "pytest_addoption",
    "pytest_configure",
    "pytest_runtest_call",
    "pytest_runtest_logreport",
    "pytest_collection_finish",
    "pytest_terminal_summary",
    "impl",
    "lab_id",
]


class LabTimeout(BaseException):
    """Raised in the test's thread when it runs past its time limit. A
    BaseException, so that neither student code nor hypothesis swallows it."""


def lab_of(path: Path) -> str | None:
    """``phases/03-x/labs/lab-02-y/test_z.py`` -> ``"03.2"``."""
    lab = phase = None
    for part in path.parts:
        if m := PHASE_DIR.match(part):
            phase = m[1]
        if m := LAB_DIR.match(part):
            lab = int(m[1])
    return f"{phase}.{lab}" if phase and lab is not None else None


def lab_title(path: Path) -> str:
    for part in path.parts:
        if LAB_DIR.match(part):
            return part.split("-", 2)[2].replace("-", " ")
    return ""


def pytest_addoption(parser):
    parser.addoption(
        "--results", default=None, help="where to write the Gradescope-style results.json"
    )
    parser.addoption(
        "--no-score-table",
        action="store_true",
        help="write results.json but leave the score table to the caller",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "points(n): what the test is worth")
    config.addinivalue_line("markers", "timeout(seconds): fail the test after this long")
    config.addinivalue_line("markers", "phase: checks the whole phase with all your labs at once")
    config._grading = {"by_id": {}}


@pytest.fixture
def lab_id(request) -> str:
    lab = lab_of(Path(str(request.node.fspath)))
    if lab is None:
        raise RuntimeError(f"{request.node.nodeid} is not inside phases/NN-*/labs/lab-MM-*/")
    return lab


@pytest.fixture
def impl(request, lab_id):
    """The modules under grade. A test marked ``phase`` gets every region
    from the student; any other gets only its own lab's."""
    phase = lab_id.split(".")[0]
    return impl_mod.load(phase if request.node.get_closest_marker("phase") else lab_id)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    marker = item.get_closest_marker("timeout")
    seconds = float(marker.args[0]) if marker else DEFAULT_TIMEOUT
    usable = hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()
    if not usable:
        yield
        return

    def on_alarm(signum, frame):
        raise LabTimeout(
            f"still running after {seconds:g} s, so it was stopped. Look for a loop that "
            "never ends (a `while` whose exit condition never becomes true, or a request "
            "that is never scheduled or never finishes)."
        )

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _message(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return crash.message
    return str(report.longrepr)[-2000:]


def pytest_runtest_logreport(report):
    entry = _STATE.get("by_id", {}).get(report.nodeid)
    if entry is None:
        return
    if report.failed and entry["status"] != "failed":
        entry["status"] = "failed"
        entry["output"] = f"{report.when}: {_message(report)}"
    elif report.skipped and entry["status"] == "pending":
        entry["status"] = "failed"
        entry["output"] = f"skipped: {_message(report)} (a skipped test earns no points)"
    elif report.when == "call" and report.passed and entry["status"] == "pending":
        entry["status"] = "passed"


def pytest_collection_finish(session):
    """Register the graded tests that will run (after any -k deselection)."""
    by_id = _STATE["by_id"] = session.config._grading["by_id"]
    for item in session.items:
        path = Path(str(item.fspath))
        lab = lab_of(path)
        if lab is None:
            continue
        marker = item.get_closest_marker("points")
        by_id[item.nodeid] = {
            "name": item.nodeid.split("::", 1)[-1],
            "lab": lab,
            "lab_title": lab_title(path),
            "max_score": float(marker.args[0]) if marker else 1.0,
            "status": "pending",
            "output": "",
        }


_STATE: dict = {}


def summarise(by_id: dict) -> tuple[dict, list]:
    labs: dict[str, dict] = defaultdict(
        lambda: {"title": "", "tests": 0, "passed": 0, "points": 0.0, "total": 0.0}
    )
    tests = []
    for t in by_id.values():
        row = labs[t["lab"]]
        row["title"] = t["lab_title"]
        row["tests"] += 1
        row["total"] += t["max_score"]
        passed = t["status"] == "passed"
        if passed:
            row["passed"] += 1
            row["points"] += t["max_score"]
        tests.append(
            {
                "name": f"Lab {t['lab']} · {t['name']}",
                "number": t["lab"],
                "score": t["max_score"] if passed else 0.0,
                "max_score": t["max_score"],
                "status": "passed" if passed else "failed",
                "output": t["output"] if not passed else "",
            }
        )
    return dict(sorted(labs.items(), key=lambda kv: [int(x) for x in kv[0].split(".")])), tests


def score_table(results: dict) -> str:
    """The score table: a row per lab (passed/tests, points/total) and the total."""
    labs = results["labs"]
    rows = [f"{'lab':<6} {'':<26} {'passed':>9} {'points':>14}"]
    for lab, r in labs.items():
        rows.append(
            f"{lab:<6} {r['title'][:26]:<26} {r['passed']:>4}/{r['tests']:<4} "
            f"{r['points']:>6g} / {r['total']:<6g}"
        )
    rows.append(
        f"{'total':<6} {'':<26} {sum(r['passed'] for r in labs.values()):>4}/"
        f"{len(results['tests']):<4} {results['score']:>6g} / {results['max_score']:<6g}"
    )
    if results["score"] < results["max_score"]:
        rows.append("Not full marks yet: the failures above say which rule broke and where.")
    return "\n".join(rows)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    by_id = config._grading.get("by_id", {})
    if not by_id:
        return
    labs, tests = summarise(by_id)
    results = {
        "score": sum(r["points"] for r in labs.values()),
        "max_score": sum(r["total"] for r in labs.values()),
        "visibility": "visible",
        "stdout_visibility": "visible",
        "tests": tests,
        "labs": {
            lab: {k: r[k] for k in ("title", "tests", "passed", "points", "total")}
            for lab, r in labs.items()
        },
    }
    path = Path(config.getoption("--results") or "results.json")
    path.write_text(json.dumps(results, indent=2) + "\n")
    if config.getoption("--no-score-table"):
        return  # `python -m mini_vllm.grading check` prints it last, after pytest's summary
    terminalreporter.section(f"score ({_graded()})")
    terminalreporter.write_line(score_table(results))
    terminalreporter.write_line(f"results: {path}")


def _graded() -> str:
    if (os.environ.get("IMPL") or "labs") == "ref":
        return "the reference"
    return f"your code in {impl_mod.labs_dir()}"
