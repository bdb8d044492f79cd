"""CI proves the graders honest, for every phase that has lab regions:

1. the reference (``IMPL=ref``) scores full marks;
2. untouched starters score zero on every lab, every test failing;
3. a solved copy (the reference's region code pasted into the starters)
   scores full marks, so every lab can be solved inside its starter.

Each runs ``python -m mini_vllm.grading check NN`` (what ``make
check-phase-NN`` runs) in a subprocess and reads its results.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mini_vllm.grading import regions as R

pytestmark = pytest.mark.slow
PHASES = R.phases()


def grade(phase: str, tmp_path: Path, *args: str) -> tuple[int, dict, str]:
    results = tmp_path / f"results-{phase}.json"
    env = {k: v for k, v in os.environ.items() if k not in ("IMPL", "MINI_VLLM_LABS_DIR")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mini_vllm.grading",
            "check",
            phase,
            "--results",
            str(results),
            *args,
        ],
        cwd=R.REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3000,
    )
    assert results.exists(), f"no results.json:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.returncode, json.loads(results.read_text()), proc.stdout


def lab_dirs(phase: str) -> set[str]:
    (folder,) = (R.REPO_ROOT / "phases").glob(f"{phase}-*")
    return {f"{phase}.{int(p.name.split('-')[1])}" for p in (folder / "labs").glob("lab-*")}


def test_every_phase_with_regions_has_graded_labs():
    assert PHASES, "no lab regions found in mini_vllm/"
    for phase in PHASES:
        missing = set(R.labs_of(phase)) - lab_dirs(phase)
        assert not missing, f"labs with regions but no graded suite: {sorted(missing)}"


@pytest.mark.parametrize("phase", PHASES)
def test_reference_scores_full_marks(phase, tmp_path):
    code, results, stdout = grade(phase, tmp_path, "--impl", "ref")
    failed = [
        t["name"] + ": " + t["output"][:300] for t in results["tests"] if t["status"] != "passed"
    ]
    assert not failed, "\n".join(failed)
    assert set(results["labs"]) == lab_dirs(phase), "a lab's suite collected no tests"
    assert results["score"] == results["max_score"] > 0 and code == 0, stdout[-2000:]


@pytest.mark.parametrize("phase", PHASES)
def test_untouched_starters_score_zero(phase, tmp_path):
    labs = tmp_path / "labs"
    subprocess.run(
        [sys.executable, "-m", "mini_vllm.grading", "generate", "--out", str(labs)],
        check=True,
        capture_output=True,
    )
    code, results, _ = grade(phase, tmp_path, "--labs-dir", str(labs))
    passing = [t["name"] for t in results["tests"] if t["status"] == "passed"]
    assert not passing, f"these pass without any student code: {passing}"
    assert set(results["labs"]) == lab_dirs(phase)
    assert all(lab["points"] == 0 for lab in results["labs"].values())
    assert code != 0


@pytest.mark.parametrize("phase", PHASES)
def test_solved_starters_score_full_marks(phase, tmp_path):
    labs = tmp_path / "solved"
    subprocess.run(
        [sys.executable, "-m", "mini_vllm.grading", "solve", "--out", str(labs)],
        check=True,
        capture_output=True,
    )
    code, results, stdout = grade(phase, tmp_path, "--labs-dir", str(labs))
    failed = [
        t["name"] + ": " + t["output"][:300] for t in results["tests"] if t["status"] != "passed"
    ]
    assert not failed, "\n".join(failed)
    assert results["score"] == results["max_score"] > 0 and code == 0, stdout[-2000:]
