"""The grader cannot be fooled, and a hang costs about a minute, not an hour.

Each test plants one fault in a solved copy of the starters (``python -m
mini_vllm.grading solve``), runs ``python -m mini_vllm.grading check`` on it
(what ``make check-phase-NN`` runs) and checks the message, the exit code,
that no score is left behind that this run did not earn, and that the grader
still works afterwards. Most run a single test or two, to keep CI cheap, and
all start from one solved copy made once for the module (``pristine``):
a test plants its fault in its own copy of it, and a test that needs a clean
copy grades ``pristine`` itself (grading reads the labs, never writes them).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mini_vllm.grading import regions as R

FREE_QUEUE = Path("phase_02/kv_cache_utils.py")  # Lab 02.1's starter
APPEND = "        self.append_n([block])\n"  # the body of FreeKVCacheBlockQueue.append
APPEND_TEST = "test_append_puts_a_block_at_the_back"  # Lab 02.1: calls append
POOL_TEST = "test_block_0_is_the_null_block_and_never_free"  # Lab 02.2: does not

# Timing-sensitive (time limits, Ctrl-C on a running grader): under
# pytest-xdist these run on one worker, in order, as they did before it.
pytestmark = pytest.mark.xdist_group("grading-robust")


def swallowing_loop(first: str = "pass") -> str:
    """A loop that swallows everything, the per-test timeout and Ctrl-C included;
    ``first`` runs inside its ``try``, before the sleeping starts. The sleeping
    loop is itself inside the ``try``: Python raises a signal's exception where
    it next checks for signals, and with a ``try`` inside ``while True`` one such
    check is the loop's jump back (JUMP_BACKWARD), outside the ``try``; here the
    only check outside it is the outer loop's, reached only after an exception
    was swallowed."""
    return (
        "        import time\n"
        "        while True:\n"
        "            try:\n"
        f"                {first}\n"
        "                while True:\n"
        "                    time.sleep(0.01)\n"
        "            except BaseException:\n"
        "                pass\n"
    )


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A solved copy of the starters (``python -m mini_vllm.grading solve``)."""
    out = tmp_path_factory.mktemp("pristine") / "solved"
    cmd = [sys.executable, "-m", "mini_vllm.grading", "solve", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, cwd=R.REPO_ROOT)
    return out


def solved(pristine: Path, tmp_path: Path) -> Path:
    """This test's own copy of ``pristine``, to plant a fault in."""
    return Path(shutil.copytree(pristine, tmp_path / "solved"))


def plant(labs: Path, rel: Path, old: str, new: str) -> None:
    path = labs / rel
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} is not once in {path}"
    path.write_text(text.replace(old, new))


def check_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "mini_vllm.grading", "check", *args]


# A terminal starts a foreground job with Ctrl-C's default action; a shell that
# runs the suite in the background (`make test &`) ignores SIGINT, and an
# ignored signal stays ignored across exec. This restores the default, then
# execs the command given after it.
WITH_DEFAULT_SIGINT = [
    sys.executable,
    "-c",
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.argv[1], sys.argv[1:])",
]


def env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("IMPL", "MINI_VLLM_LABS_DIR")}


def check(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        check_cmd(*args), cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout
    )


def stale_score(cwd: Path) -> Path:
    """A results.json from an earlier run, with full marks."""
    path = cwd / "results.json"
    path.write_text(json.dumps({"run_id": "old", "score": 9.0, "max_score": 9.0}))
    return path


def assert_grader_still_works(labs: Path, cwd: Path) -> None:
    """A clean solved copy, one test: full marks, exit 0."""
    proc = check("02.1", "--labs-dir", str(labs), "--", "-k", APPEND_TEST, cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = json.loads((cwd / "results.json").read_text())
    assert results["score"] == results["max_score"] == 1.0
    assert f"(run {results['run_id']})" in proc.stdout


def test_a_lab_that_exits_the_process_gets_no_score(pristine, tmp_path):
    """os._exit(0) in the code under grade: pytest's exit code would be 0,
    but no results were written by this run, so check fails."""
    labs = solved(pristine, tmp_path)
    plant(labs, FREE_QUEUE, APPEND, "        import os\n\n        os._exit(0)\n")
    old = stale_score(tmp_path)
    proc = check("02.1", "--labs-dir", str(labs), "--", "-k", APPEND_TEST, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert "ended (exit code 0) without writing this run's results" in proc.stdout
    assert APPEND_TEST in proc.stdout and "os._exit()" in proc.stdout
    assert "No score" in proc.stdout and "Score (" not in proc.stdout
    assert not old.exists()
    assert_grader_still_works(pristine, tmp_path)


def test_a_run_that_selects_no_test_gets_no_score(pristine, tmp_path):
    labs = pristine
    old = stale_score(tmp_path)
    proc = check("02.1", "--labs-dir", str(labs), "--", "-k", "no_such_test", cwd=tmp_path)
    assert proc.returncode == 1
    assert "No graded test was selected" in proc.stdout and "Score (" not in proc.stdout
    assert not old.exists(), "the earlier run's score must not survive as this run's"
    assert_grader_still_works(labs, tmp_path)


def test_two_graders_in_one_folder_print_their_own_scores(pristine, tmp_path):
    """Run at once in one folder, a full-marks grader and a zero grader each
    print their own score; results.json is one whole run's, never a mix."""
    labs = {"full": pristine, "zero": tmp_path / "starters"}
    gen = [sys.executable, "-m", "mini_vllm.grading", "generate", "--out", str(labs["zero"])]
    subprocess.run(gen, check=True, capture_output=True, cwd=R.REPO_ROOT)
    procs = {
        name: subprocess.Popen(
            check_cmd("02.1", "--labs-dir", str(path), "--", "-k", APPEND_TEST),
            cwd=tmp_path,
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, path in labs.items()
    }
    out = {name: p.communicate(timeout=300)[0] for name, p in procs.items()}
    assert procs["full"].returncode == 0 and "1 / 1" in out["full"], out["full"][-2000:]
    assert procs["zero"].returncode == 1 and "0 / 1" in out["zero"], out["zero"][-2000:]
    results = json.loads((tmp_path / "results.json").read_text())
    winner = next(n for n in out if f"(run {results['run_id']})" in out[n])
    assert results["score"] == {"full": 1.0, "zero": 0.0}[winner]


def test_a_loop_that_swallows_the_timeout_is_stopped_and_the_rest_graded(pristine, tmp_path):
    """A loop catching BaseException ignores the per-test timeout: check stops
    the run past the limit, names the test and the function, and grades the
    tests not yet run (here one of another lab) in a new run."""
    labs = solved(pristine, tmp_path)
    plant(labs, FREE_QUEUE, APPEND, swallowing_loop())
    args = ["02", "--labs-dir", str(labs), "--", "-k", f"{APPEND_TEST} or {POOL_TEST}"]
    proc = check(*args, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    by_name = {t["name"].split(" · ")[1]: t for t in results["tests"]}
    hung = by_name[APPEND_TEST]["output"]
    assert "stuck in `append`" in hung and "catch BaseException" in hung, hung
    assert by_name[POOL_TEST]["status"] == "passed", "the other lab must still be graded"
    assert results["score"] == results["max_score"] - by_name[APPEND_TEST]["max_score"] > 0
    # upstream's own tests would run into the same loop: the phase check leaves them out
    assert "upstream's own unit tests: not run (a graded test hung" in proc.stdout, proc.stdout


def test_ctrl_c_stops_a_loop_that_swallows_it(pristine, tmp_path):
    """Ctrl-C while a loop catching BaseException runs: check stops it,
    says where it was, gives no score, exits 130."""
    labs = solved(pristine, tmp_path)
    started = tmp_path / "started"
    # Written inside the loop's try, so that from then on a Ctrl-C is swallowed.
    # Written before the loop, as it was, a Ctrl-C sent as soon as the file appeared
    # escaped 4 times in 400 on a loaded machine and ended the test before the loop.
    plant(labs, FREE_QUEUE, APPEND, swallowing_loop(f"open({str(started)!r}, 'w').close()"))
    old = stale_score(tmp_path)
    proc = subprocess.Popen(
        WITH_DEFAULT_SIGINT + check_cmd("02.1", "--labs-dir", str(labs), "--", "-k", APPEND_TEST),
        cwd=tmp_path,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a terminal gives it
    )
    try:
        deadline = time.monotonic() + 240
        while not started.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert started.exists(), "the planted loop never started"
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        out = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out[-3000:]
    assert f"Interrupted during {'phases/'}" in out and APPEND_TEST in out, out[-3000:]
    assert "in `append`" in out and "Score (" not in out
    assert not old.exists()
    assert_grader_still_works(pristine, tmp_path)


@pytest.mark.slow
def test_a_hang_in_phase_03_costs_one_time_limit(pristine, tmp_path):
    """A `while True` planted in Lab 03.5's region of update_from_output:
    check 03 spends one time limit on it, not one a test: the first Lab 03.5
    test that reaches it names the function that hung, the lab's later tests
    and the whole-phase tests (Lab 03.7) fail at once naming that test, and
    another lab is still graded. Only Labs 03.5, 03.7 and one test of Lab 03.1 are selected, to
    keep CI cheap: the others run as in any check."""
    labs = solved(pristine, tmp_path)
    plant(
        labs,
        Path("phase_03/scheduler.py"),
        "            finish_reason = None\n            if stopped:\n",
        "            finish_reason = None\n            while True:\n                pass\n"
        "            if stopped:\n",
    )
    selected = "test_lab05 or test_lab07 or test_gate_max_num_seqs"
    # "One time limit" is asserted by what the grader did, not by the wall clock (a busy
    # machine stretches the wall; the limit counts the test's own time): exactly one test
    # ran into the limit, and every test after it failed at once without running.
    proc = check("03", "--labs-dir", str(labs), "--", "-k", selected, cwd=tmp_path, timeout=600)
    assert proc.returncode == 1
    results = json.loads((tmp_path / "results.json").read_text())
    lab5 = [t for t in results["tests"] if t["number"] == "03.5"]
    hung = [i for i, t in enumerate(lab5) if "still running after" in t["output"]]
    assert len(hung) == 1, [t["output"][:200] for t in lab5]
    first, rest = lab5[hung[0]], lab5[hung[0] + 1 :]
    assert "`update_from_output`" in first["output"], first["output"]
    hung_test = first["name"].split(" · ")[1]
    lab7 = [t for t in results["tests"] if t["number"] == "03.7"]
    assert rest and lab7
    for t in rest + lab7:
        assert "not run" in t["output"] and hung_test in t["output"], t["output"]
        assert "`update_from_output`" in t["output"], t["output"]
    assert results["labs"]["03.1"]["points"] == results["labs"]["03.1"]["total"] > 0
    assert hung_test in proc.stdout and "update_from_output" in proc.stdout
    assert "upstream's own unit tests: not run (a graded test hung" in proc.stdout


def test_a_swallowing_loop_in_the_only_test_selected_still_gets_a_score(pristine, tmp_path):
    """The stuck test was the last one left: no new run is needed to grade the
    rest, so check scores what it has (0 of 1 here) and names the hung test,
    rather than restarting a run with nothing to run and giving no score."""
    labs = solved(pristine, tmp_path)
    plant(labs, FREE_QUEUE, APPEND, swallowing_loop())
    proc = check("02.1", "--labs-dir", str(labs), "--", "-k", APPEND_TEST, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "ended the process early" not in proc.stdout, proc.stdout[-3000:]
    assert "Score (" in proc.stdout and "0 / 1" in proc.stdout, proc.stdout[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    (test,) = results["tests"]
    assert APPEND_TEST in test["name"] and "stuck in `append`" in test["output"], test


def test_results_in_a_folder_that_does_not_exist_yet(pristine, tmp_path):
    """--results names a file in a folder that is not there: the folder is made
    and the score written, instead of a traceback after every test ran."""
    out = tmp_path / "new" / "deeper" / "r.json"
    args = ["02.1", "--labs-dir", str(pristine), "--results", str(out)]
    proc = check(*args, "--", "-k", APPEND_TEST, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert json.loads(out.read_text())["score"] == 1.0


def test_results_that_cannot_be_written_are_refused_before_grading(pristine, tmp_path):
    """--results under a path that is a file: one line before any test runs."""
    (tmp_path / "afile").write_text("")
    bad = tmp_path / "afile" / "r.json"
    proc = check("02.1", "--labs-dir", str(pristine), "--results", str(bad), cwd=tmp_path)
    assert proc.returncode != 0
    assert "--results" in proc.stderr and str(bad) in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "passed" not in proc.stdout, proc.stdout[-2000:]


POOL = Path("phase_02/block_pool.py")  # Lab 02.2's starter
BROKEN_POOL = (  # a bug: every allocation fails
    "\n\ndef _planted(self, num_blocks):\n"
    "    raise RuntimeError('a planted bug')\n\n\n"
    "BlockPool.get_new_blocks = _planted\n"
)
REBIND_THE_GRADER = (  # what a lab could do to its grader
    "\nimport mini_vllm.grading.kv_checks as _kc\n\n"
    "_kc.snapshot_mismatch = _kc.reference_mismatch = lambda *a, **k: None\n"
    "_kc.expect_raises = lambda *a, **k: None\n"
)


def test_a_lab_cannot_raise_its_grade_by_rebinding_the_grader(pristine, tmp_path):
    """A lab 02.2 whose allocation fails, graded twice: as it is, and with
    the grader's checks rebound at its import. The second must not score
    more than the first, and says what was changed."""
    selected = ["--", "-k", "beyond_the_free_count or test_snapshot"]
    scores, outputs = {}, {}
    for name, extra in (("bug", ""), ("bug and rebinding", REBIND_THE_GRADER)):
        labs = Path(shutil.copytree(pristine, tmp_path / name.replace(" ", "-")))
        with (labs / POOL).open("a") as f:
            f.write(BROKEN_POOL + extra)
        proc = check("02.2", "--labs-dir", str(labs), *selected, cwd=tmp_path)
        assert proc.returncode == 1, proc.stdout[-3000:]
        results = json.loads((tmp_path / "results.json").read_text())
        scores[name] = results["score"]
        outputs[name] = [t["output"] for t in results["tests"]]
    assert scores["bug and rebinding"] <= scores["bug"] == 0, scores
    rebound = [o for o in outputs["bug and rebinding"] if "changed the grader" in o]
    assert rebound and "kv_checks.snapshot_mismatch" in rebound[0], outputs


LOADED_SUITE = """
import pytest

@pytest.mark.timeout({limit})
def test_fixed_work():
    total = 0
    for i in range({iterations}):
        total += i
"""


def test_a_busy_machine_does_not_turn_a_correct_lab_into_a_hang(tmp_path):
    """A graded test doing about 1 s of work, under a 2 s limit, while
    2 busy processes per core run beside it (a laptop at load average 5+
    on 2 cores): it passes, because the limit is kept on time the test
    got, not on the wall clock (mini_vllm/grading/clock.py). On the wall
    clock it took 3 s or more and was reported as hung."""
    from mini_vllm.grading import run

    start, iterations = time.process_time(), 0
    while time.process_time() - start < 0.2:  # the loop's rate, in CPU time
        iterations += sum(1 for _ in range(100_000))
    lab = tmp_path / "phases" / "99-load" / "labs" / "lab-01-work"
    lab.mkdir(parents=True)
    (lab.parents[1] / "conftest.py").write_text("from mini_vllm.grading.plugin import *\n")
    (lab / "test_lab01_work.py").write_text(LOADED_SUITE.format(limit=2, iterations=iterations * 5))
    hog = [sys.executable, "-c", "while True: pass"]
    hogs = [subprocess.Popen(hog) for _ in range(2 * (os.cpu_count() or 1))]
    try:
        wall = time.monotonic()
        outcome = run.grade(lab.parents[1], ["-p", "no:xdist"])
        wall = time.monotonic() - wall
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    (test,) = outcome.results["tests"]
    assert test["status"] == "passed", (wall, test["output"])
    assert not outcome.hung and outcome.complete
