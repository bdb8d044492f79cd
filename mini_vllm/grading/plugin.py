"""The pytest plugin behind ``make check-phase-NN``: points, timeouts, scores.

Graded tests live in ``phases/NN-slug/labs/lab-MM-slug/``; the folder names
the lab (``NN.M``). A test is worth ``@pytest.mark.points(n)`` points (1 if
unmarked); its setup (the fixtures that load the code under grade) and its
body each get ``@pytest.mark.timeout(seconds)`` (``DEFAULT_TIMEOUT`` if
unmarked) before it is failed as a likely infinite loop. At the end the
plugin prints a score table and writes a Gradescope-style ``results.json``
(atomically, tagged with the run's id; nothing when no graded test ran or
the run was interrupted). The ``impl`` fixture hands a test the code under
grade (see ``impl.py``).

A hang costs one time limit per lab, not one per test: once a test times
out, the lab's other tests fail at once naming the test and the function
that hung, and so do the phase's whole-phase tests (they run every region,
the hung one included). ``--grading-events`` makes the plugin log, as JSON
lines, when each test's setup and body start (with its limit), a hang and
the result: ``python -m mini_vllm.grading check`` reads them to stop a run
whose code swallowed the timeout (see ``run.py``).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import re
import signal
import threading
import traceback
import uuid
from collections import defaultdict
from pathlib import Path

import pytest

from mini_vllm.grading import impl as impl_mod
from mini_vllm.grading.clock import TestClock
from mini_vllm.grading.integrity import Seal
from mini_vllm.grading.regions import REPO_ROOT

# Most graded tests take well under a second on the reference; this leaves
# room for a loaded 2-core machine. Slower tests (properties, real models)
# carry their own @pytest.mark.timeout, set from `--durations=0` runs.
DEFAULT_TIMEOUT = 20.0
LAB_DIR = re.compile(r"^lab-(\d+)-[\w-]+$")
PHASE_DIR = re.compile(r"^(\d\d)-[\w-]+$")

__all__ = [
    "pytest_addoption",
    "pytest_configure",
    "pytest_sessionstart",
    "pytest_collection_modifyitems",
    "pytest_runtest_setup",
    "pytest_runtest_call",
    "pytest_runtest_teardown",
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
    parser.addoption(
        "--grading-events", default=None, help="log test starts, hangs and results here"
    )
    parser.addoption(
        "--grading-skip",
        default=None,
        help="a file of node ids (one a line) already graded earlier in this run: leave them out",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "points(n): what the test is worth")
    config.addinivalue_line("markers", "timeout(seconds): fail the test after this long")
    config.addinivalue_line("markers", "phase: checks the whole phase with all your labs at once")
    config.addinivalue_line("markers", "upstream: drives the pinned upstream vLLM")
    config._grading = {"by_id": {}, "hung": {}, "hung_tests": {}}
    events = config.getoption("--grading-events")
    if events and hasattr(signal, "SIGTERM"):
        # What a check stopping this run reads: where each thread was when it
        # was stopped (dumped by the interpreter, whatever the code under grade does).
        config._grading["stacks"] = stacks = open(f"{events}.stacks", "w")
        faulthandler.register(signal.SIGTERM, file=stacks, all_threads=True, chain=True)


def pytest_sessionstart(session):
    """No score from an earlier run may survive this one (it would read as current)."""
    Path(session.config.getoption("--results") or "results.json").unlink(missing_ok=True)


def pytest_collection_modifyitems(session, config, items):
    skip = config.getoption("--grading-skip")
    if not skip:
        return
    done = set(Path(skip).read_text().splitlines())
    config.hook.pytest_deselected(items=[i for i in items if i.nodeid in done])
    items[:] = [i for i in items if i.nodeid not in done]


def _event(config, **event) -> None:
    path = config.getoption("--grading-events")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(event) + "\n")


def hung_where(frame) -> str:
    """The innermost frame of the project's code or the code under grade in
    ``frame``'s stack, as ``function (file:line: `code`)``."""
    ours = (str(REPO_ROOT), str(impl_mod.labs_dir()))
    stack = traceback.extract_stack(frame)
    inner = [f for f in stack if f.filename.startswith(ours) and "/.venv/" not in f.filename]
    f = (inner or stack)[-1]
    return f"`{f.name}` ({f.filename}:{f.lineno}: `{(f.line or '').strip()}`)"


def not_run_message(config, item) -> str | None:
    """Why ``item`` fails without running, after a hang earlier in this run."""
    hung = config._grading["hung"]
    lab = lab_of(Path(str(item.fspath)))
    if lab is None:
        return None
    if lab in hung:
        nodeid, where = hung[lab]
        return (
            f"not run: {nodeid} of this lab hung in {where}, so the lab's other tests fail "
            "at once instead of each waiting out its time limit. Fix that loop and check again."
        )
    phase = lab.split(".")[0]
    earlier = [v for k, v in hung.items() if k and k.split(".")[0] == phase]
    if item.get_closest_marker("phase") and earlier:
        nodeid, where = earlier[0]
        return (
            f"not run: {nodeid} hung in {where}; this whole-phase check runs every one of your "
            "regions, that one included, so it would hang too. Fix that loop and check again."
        )
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    """Fixtures load and may run the code under grade: they get the limit too."""
    _event(item.config, event="setup", nodeid=item.nodeid, limit=time_limit(item))
    if (message := not_run_message(item.config, item)) is not None:
        pytest.fail(message, pytrace=False)
    with alarm(item):
        yield


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


def time_limit(item) -> float:
    marker = item.get_closest_marker("timeout")
    return float(marker.args[0]) if marker else DEFAULT_TIMEOUT


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    _event(item.config, event="call", nodeid=item.nodeid, limit=time_limit(item))
    with alarm(item):
        yield


@contextlib.contextmanager
def alarm(item):
    """Raise LabTimeout in the test once it has had more than its limit (on
    clock.py's clock: time waiting for a busy CPU is not counted), naming
    where it was."""
    seconds = time_limit(item)
    usable = hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()
    if not usable:
        yield
        return

    def on_alarm(signum, frame):
        where = hung_where(frame)
        message = (
            f"still running after {seconds:g} s (time spent waiting for a busy CPU not "
            f"counted), so it was stopped, in {where}. Look for a loop that never ends (a "
            "`while` whose exit condition never becomes true, or a request that is never "
            "scheduled or never finishes)."
        )
        # Recorded before raising: code that swallows the exception cannot undo it.
        grading = item.config._grading
        lab = lab_of(Path(str(item.fspath)))
        grading["hung"].setdefault(lab, (item.nodeid, where))
        grading["hung_tests"][item.nodeid] = message
        _event(item.config, event="hung", nodeid=item.nodeid, output=message)
        raise LabTimeout(message)

    clock = TestClock()

    def on_timer(signum, frame):
        # The wall clock ran out; the time this test got (clock.py) may not have.
        left = seconds - clock.elapsed()
        if left > 0:
            signal.setitimer(signal.ITIMER_REAL, max(left, 0.2))
            return
        on_alarm(signum, frame)

    previous = signal.signal(signal.SIGALRM, on_timer)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Once the test's fixtures are torn down: did the code under grade
    change the grader (integrity.py)? Put it back and fail the test."""
    result = yield
    seal = _STATE.get("seal")
    changed = seal.broken() if seal is not None else []
    if changed:
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        pytest.fail(
            f"the code under grade changed the grader: {', '.join(changed[:3])}{more}. "
            "The grader put it back, and this test earns nothing: a lab is graded by the "
            "grader's checks, so leave its modules (and pytest's) alone.",
            pytrace=False,
        )
    return result


def _message(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return crash.message
    return str(report.longrepr)[-2000:]


def pytest_runtest_logreport(report):
    entry = _STATE.get("by_id", {}).get(report.nodeid)
    if entry is None:
        return
    hung = _STATE["hung_tests"].get(report.nodeid)
    if hung is not None and entry["status"] != "failed":
        # It timed out, whatever the test did with the exception.
        entry["status"] = "failed"
        entry["output"] = f"call: {hung}"
    elif report.failed and entry["status"] != "failed":
        entry["status"] = "failed"
        entry["output"] = f"{report.when}: {_message(report)}"
    elif report.skipped and entry["status"] == "pending":
        entry["status"] = "failed"
        entry["output"] = f"skipped: {_message(report)} (a skipped test earns no points)"
    elif report.when == "call" and report.passed and entry["status"] == "pending":
        entry["status"] = "passed"
    if report.when == "teardown":
        _event(_STATE["config"], event="result", nodeid=report.nodeid, **entry)


def pytest_collection_finish(session):
    """Register the graded tests that will run (after any -k deselection)."""
    _STATE["config"] = session.config
    _STATE["hung_tests"] = session.config._grading["hung_tests"]
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
            "whole_phase": item.get_closest_marker("phase") is not None,
        }
    _event(session.config, event="collected", tests=by_id)
    # Before the first test: code under grade is loaded only inside tests.
    _STATE["seal"] = seal = Seal()
    seal.record_new_modules()


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


def results_of(by_id: dict, run_id: str) -> dict:
    """The Gradescope-style results of the graded tests in ``by_id``."""
    labs, tests = summarise(by_id)
    return {
        "run_id": run_id,
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


def write_results(path: Path, results: dict) -> None:
    """Write all of ``results`` or nothing: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    os.replace(tmp, path)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    by_id = config._grading.get("by_id", {})
    if exitstatus == pytest.ExitCode.INTERRUPTED:
        terminalreporter.write_line("Interrupted: no score was written.")
        return
    if not by_id:
        return
    run_id = os.environ.get("MINI_VLLM_RUN_ID") or uuid.uuid4().hex
    results = results_of(by_id, run_id)
    path = Path(config.getoption("--results") or "results.json")
    write_results(path, results)
    if config.getoption("--no-score-table"):
        return  # `python -m mini_vllm.grading check` prints it last, after pytest's summary
    terminalreporter.section(f"score ({_graded()})")
    terminalreporter.write_line(score_table(results))
    terminalreporter.write_line(f"results: {path}")


def _graded() -> str:
    if (os.environ.get("IMPL") or "labs") == "ref":
        return "the reference"
    return f"your code in {impl_mod.labs_dir()}"
