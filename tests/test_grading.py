"""The grading machinery itself: regions, starters, splicing, the pytest plugin.

The honesty of the real graded suites is checked in test_labs_honest.py;
here small made-up inputs pin down each piece's behaviour.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mini_vllm.grading import regions as R

REPO = R.REPO_ROOT


def test_markers_must_pair_up():
    ok = ["x = 1", "    # BEGIN LAB 03.1: t", "    y = 2", "    # END LAB 03.1"]
    (region,) = R.find_regions(ok)
    assert (region.lab, region.title, region.begin, region.end) == ("03.1", "t", 1, 3)
    with pytest.raises(R.RegionError, match="never closed"):
        R.find_regions(ok[:3])
    with pytest.raises(R.RegionError, match="without a matching BEGIN"):
        R.find_regions(["# END LAB 03.1"])
    with pytest.raises(R.RegionError, match="inside LAB"):
        R.find_regions(["# BEGIN LAB 03.1", "# BEGIN LAB 03.2", "# END LAB 03.2", "# END LAB 03.1"])
    with pytest.raises(R.RegionError, match="indented differently"):
        R.find_regions(["  # BEGIN LAB 03.1", "# END LAB 03.1"])
    with pytest.raises(R.RegionError, match="malformed"):
        R.find_regions(["# BEGIN LAB 3.1"])


def test_splice_replaces_only_the_named_regions():
    text = "a\n# BEGIN LAB 01.1\nold1\n# END LAB 01.1\nb\n# BEGIN LAB 01.2\nold2\n# END LAB 01.2\n"
    out = R.splice(text, {1: ["new2a", "new2b"]})
    assert out == text.replace("old2", "new2a\nnew2b")


def test_starter_keeps_signature_docstring_hints_and_raises():
    starter = R.starters("03")[Path("phase_03/utils.py")]
    assert "def check_stop(request: Request, max_model_len: int) -> bool:" in starter
    assert "Set a finished status on the request" in starter
    assert "# HINT:" in starter
    # The message may be wrapped onto its own line (ruff format's style).
    raise_at = starter.index("raise NotImplementedError(")
    assert starter[raise_at:].split("(", 1)[1].lstrip().startswith('"Lab 03.5:')
    assert "FINISHED_STOPPED\n" not in starter.split("def check_stop")[1].split('"""')[2]
    # Everything outside the holes comes from the reference.
    assert "from mini_vllm.core.sched.utils import remove_all" in starter


def test_scheduler_starter_subclasses_the_reference():
    starter = R.starters("03")[Path("phase_03/scheduler.py")]
    assert "class Scheduler(_reference.Scheduler):" in starter
    # Imports of sibling starters are redirected, so the student's check_stop is used.
    assert "from labs.phase_03.utils import check_stop" in starter
    # Methods without a lab stay inherited.
    assert "def add_request" not in starter and "def finish_requests" not in starter


def test_committed_labs_folder_is_current():
    assert R.stale_files(REPO / "labs") == [], "run `make labs` and commit labs/"


def test_staleness_ignores_student_code_but_not_outside_edits(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "mini_vllm.grading", "generate", "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    utils = tmp_path / "phase_03" / "utils.py"
    text = utils.read_text()
    utils.write_text(
        text.replace(
            "    raise NotImplementedError",
            "    return False  # mine\n    raise NotImplementedError",
        )
    )
    assert R.stale_files(tmp_path) == []
    utils.write_text(text.replace("import remove_all", "import remove_all as _gone"))
    assert [p for p in R.stale_files(tmp_path) if "utils.py" in p]


GENERATE = [sys.executable, "-m", "mini_vllm.grading", "generate"]


def _generate(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        GENERATE + ["--out", str(out), *extra], capture_output=True, text=True, check=False
    )


# Three edits to an untouched phase_03/utils.py starter, all inside Lab 03.5's
# whole-function region, that the generator must undo: a hint, the signature,
# the docstring.
STALE_EDITS = {
    "hint": ("    # HINT: the request's", "    # HINT: an old hint: the request's"),
    "signature": ("max_model_len: int) -> bool:", "max_len: int) -> bool:"),
    "docstring": ("Returns True if it did.", "Returns whether it did."),
}


@pytest.mark.parametrize("edit", sorted(STALE_EDITS))
def test_check_names_a_stale_starter_and_generate_rewrites_it(tmp_path, edit):
    assert _generate(tmp_path).returncode == 0
    utils = tmp_path / "phase_03" / "utils.py"
    fresh = utils.read_text()
    old, new = STALE_EDITS[edit]
    assert fresh.count(old) == 1
    utils.write_text(fresh.replace(old, new))
    assert R.stale_files(tmp_path) == ["phase_03/utils.py: out of date with the reference"]
    check = _generate(tmp_path, "--check")
    assert check.returncode == 1 and f"stale: {utils}" in check.stdout
    out = _generate(tmp_path)
    assert out.returncode == 0 and "wrote 1 starter files" in out.stdout, out.stdout
    assert utils.read_text() == fresh and R.stale_files(tmp_path) == []


def test_generate_updates_a_starter_keeping_student_code(tmp_path):
    """Code in one region survives; a stale hint in a stub region and an edit
    outside the regions are brought up to date."""
    assert _generate(tmp_path).returncode == 0
    sched = tmp_path / "phase_03" / "scheduler.py"
    fresh = sched.read_text()
    stub = "            new_blocks = None  # yours to set: the code after the region reads it\n"
    mine = "            new_blocks = self.kv_cache_manager.allocate_slots(request, 1)  # mine\n"
    hint = "            # HINT: receives request, new_blocks, num_new_tokens;"
    outside = "            if request.spec_token_ids:"
    for old in (stub, hint, outside):
        assert fresh.count(old) == 1
    worked = fresh.replace(stub, mine)
    sched.write_text(
        worked.replace(hint, hint.replace("receives", "gets")).replace(
            outside, outside + "  # edited"
        )
    )
    assert [p for p in R.stale_files(tmp_path) if "scheduler.py" in p]
    out = _generate(tmp_path)
    assert out.returncode == 0 and "wrote 1 starter files" in out.stdout, out.stdout
    assert sched.read_text() == worked
    assert R.stale_files(tmp_path) == []  # the student's code alone is not staleness


def test_generate_never_overwrites_student_code(tmp_path):
    assert _generate(tmp_path).returncode == 0
    utils = tmp_path / "phase_03" / "utils.py"
    mine = utils.read_text().replace(
        "    raise NotImplementedError", "    x = 1  # my work\n    raise NotImplementedError"
    )
    utils.write_text(mine)
    assert _generate(tmp_path).returncode == 0 and utils.read_text() == mine
    # Its function's signature differs from the reference's: the code cannot be
    # carried into the fresh starter, so generate refuses and says how.
    renamed = mine.replace("max_model_len: int) -> bool:", "max_len: int) -> bool:")
    utils.write_text(renamed)
    out = _generate(tmp_path)
    assert out.returncode == 1 and f"kept {utils}: LAB 03.5 holds your code" in out.stdout
    assert "--force" in out.stdout and utils.read_text() == renamed
    assert R.stale_files(tmp_path) == [
        "phase_03/utils.py: LAB 03.5 holds your code, and the def line or docstring of its "
        "function differs from the reference's"
    ]
    assert _generate(tmp_path, "--force").returncode == 0
    assert "my work" not in utils.read_text() and R.stale_files(tmp_path) == []


def _fake_phase(tmp_path: Path) -> Path:
    labs = tmp_path / "phases" / "99-demo" / "labs"
    (labs / "lab-01-demo").mkdir(parents=True)
    (labs / "lab-01-demo" / "test_demo.py").write_text(
        textwrap.dedent("""
        import pytest

        @pytest.mark.points(3)
        def test_passes():
            assert 1 + 1 == 2

        @pytest.mark.points(2)
        def test_student_bug():
            raise KeyError("student code blew up")

        def test_teaching_message():
            assert 3 == 4, "step 2: the budget was exceeded (expected 3, got 4)"

        def spin():
            while True:
                pass

        @pytest.mark.points(4)
        @pytest.mark.timeout(1)
        def test_infinite_loop():
            spin()

        def test_after_the_hang():
            assert True  # would pass, but its lab already hung
    """)
    )
    (labs / "lab-02-other").mkdir()
    (labs / "lab-02-other" / "test_other.py").write_text(
        textwrap.dedent("""
        import pytest

        @pytest.mark.points(5)
        def test_other_lab_is_still_graded():
            assert True

        @pytest.mark.phase
        def test_whole_phase():
            assert True  # would pass, but it runs every region, the hung one too
    """)
    )
    return labs


def test_plugin_scores_times_out_and_reports_each_failure(tmp_path):
    labs = _fake_phase(tmp_path)
    results = tmp_path / "results.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            str(labs),
            "-p",
            "mini_vllm.grading.plugin",
            "-p",
            "no:cacheprovider",
            "-q",
            "--rootdir",
            str(tmp_path),
            "--results",
            str(results),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 1
    assert "99.1" in proc.stdout and "3 / 11" in proc.stdout  # the score table
    data = json.loads(results.read_text())
    assert (data["score"], data["max_score"]) == (8.0, 17.0)
    assert data["run_id"]
    by_name = {t["name"].split(" · ")[1]: t for t in data["tests"]}
    assert by_name["test_passes"]["status"] == "passed"
    assert "KeyError" in by_name["test_student_bug"]["output"]
    assert "the budget was exceeded" in by_name["test_teaching_message"]["output"]
    hung = by_name["test_infinite_loop"]["output"]
    assert "still running after 1 s" in hung and "`spin`" in hung
    # After the hang, the lab's other tests and the whole-phase test fail at once,
    # naming the test and the function that hung; the other lab is still graded.
    for name in ("test_after_the_hang", "test_whole_phase"):
        out = by_name[name]["output"]
        assert "not run" in out and "test_demo.py::test_infinite_loop" in out, out
        assert "hung in `spin`" in out, out
    assert by_name["test_other_lab_is_still_graded"]["status"] == "passed"
    assert [t["number"] for t in data["tests"]] == ["99.1"] * 5 + ["99.2"] * 2


def test_check_rejects_unknown_targets():
    def run(*a):
        return subprocess.run(
            [sys.executable, "-m", "mini_vllm.grading", "check", *a],
            capture_output=True,
            text=True,
            cwd=REPO,
        )

    assert "give a phase like 03" in run("3.x").stderr
    assert "No phase 42" in run("42").stderr
    assert "has no lab 9" in run("03.9").stderr


def test_a_scheduler_that_stops_advancing_fails_at_once():
    """A scheduler that never takes in the sampled tokens stalls once the
    prompts are computed: the driver says so after NO_PROGRESS_STEPS steps,
    with the state, instead of running to max_steps or a time limit."""
    from mini_vllm.core.sched.scheduler import Scheduler
    from mini_vllm.engine import EngineCoreOutputs
    from mini_vllm.grading import checks
    from mini_vllm.oracle.scenarios import get_scenario
    from mini_vllm.oracle.workload import NO_PROGRESS_STEPS

    class NeverAppends(Scheduler):
        def update_from_output(self, scheduler_output, model_runner_output):
            return EngineCoreOutputs()

    message = checks.reference_mismatch(NeverAppends, get_scenario("preemption_fcfs"))
    assert f"no request advanced for {NO_PROGRESS_STEPS} steps" in message, message
    assert "RUNNING" in message and "free KV blocks" in message, message
    assert checks.reference_mismatch(Scheduler, get_scenario("preemption_fcfs")) is None


def test_explain_keys_fail_loudly_when_the_reference_text_changes():
    """Labs 03.1-03.3's explain() keys on reference text through
    reference_text(), which raises when the text is gone (so the suite fails
    at collection instead of silently dropping its explanations)."""
    sys.path.insert(0, str(REPO / "phases/03-continuous-batching-scheduler/labs"))
    try:
        import phase03_helpers as helpers
    finally:
        sys.path.pop(0)
    key = "assert token_budget >= 0"
    assert helpers.reference_text(key, helpers.SCHEDULER) == key
    with pytest.raises(LookupError, match="no longer holds"):
        helpers.reference_text(key + " and a changed line", helpers.SCHEDULER)
