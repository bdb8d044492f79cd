"""CI proves the graders honest, for every phase that has lab regions:

1. the reference (``IMPL=ref``) scores full marks;
2. untouched starters score zero on every lab, every test failing;
3. a solved copy (the reference's region code pasted into the starters)
   scores full marks, so every lab can be solved inside its starter.

Each runs ``python -m mini_vllm.grading check NN`` (what ``make
check-phase-NN`` runs) in a subprocess and reads its results.json. The
subprocess inherits the tier (mini_vllm/tiers.py): in the fast tier the
graded properties run a quarter of their examples.

The tiers split the third proof. ``make test`` (fast) shows the solved copy
equal to the reference by construction: every function and method a starter
re-opens is, in the solved copy, the reference's statement for statement
(compared as syntax trees), and every class there subclasses the reference's
class of the same name. So the solved copy grades as the reference does,
which proof 1 runs; what is left, the starters' imports and wiring, proof 2
runs (every failure must come from an unwritten region, not an import).
``make test-deep`` grades the whole solved copy as well, the labs below that
only the solved copy runs included.

What runs once per phase, not three times (CI's time; each saving below
says which run keeps the proof):

- the line of upstream's own unit tests (information, not points; the
  phases in the upstream suite's ``LAB_FILES``: 02, 03, 05, 06, 07, 08, 12, 13,
  14 and 15) runs on the starters and on the solved copy, where its count is
  checked: all pass on the solved copy, not all on the starters (so it
  grades the student's code, not the reference's). The reference's run
  leaves it out (``--no-upstream-tests``): ``make upstream-tests``, also in
  CI, runs those same in-scope tests on the reference and fails on any.
- Lab 03.7 (SmolLM2 driven by your scheduler and by the reference's, token
  for token) runs on the solved copy only: there every region holds the
  reference's code and the test compares it with the reference Scheduler,
  so it passes exactly when the reference would. The reference's own run
  (``IMPL=ref``) would compare the reference with itself; what it adds, that
  ``IMPL=ref`` hands the test the reference modules, every other Phase 03
  test of that run proves through the same ``impl`` fixture.
- Lab 08.4 (the runner's verification metadata, then SmolLM2 greedy through
  an engine built from every Phase 08 piece) runs on the solved copy only,
  for the same reason: every region there holds the reference's code, so it
  passes exactly when the reference would, and the reference engine's
  speculation is proven against transformers by tests/test_spec_decode_engine.py.
- Lab 12.4 (SmolLM2 through an engine built from every Phase 12 piece, 50
  JSON-schema prompts, tokens equal to transformers' masked argmax) runs on
  the solved copy only, for the same reason; the reference engine's
  constrained tokens are proven against transformers' by
  tests/test_structured_output.py.
- Lab 13.4 (a tiny seeded LLaVA through an engine built from every Phase
  13 piece, greedy tokens equal to transformers', batched with text and
  with chunks cutting through images) runs on the solved copy only, for the
  same reason; the reference engine's multimodal tokens are proven against
  transformers' by tests/test_llava_model.py.
- Lab 10.4 (SmolLM2 loaded four ways through every Phase 10 piece, against
  float32 by the formats' bounds) runs on the solved copy only, for the
  same reason; the reference's quantized runs are proven by
  tests/test_quantization_gguf.py, test_quantization_linear.py and
  test_kv_cache_fp8.py.
- Lab 11.4 (the LoRA layer and wrapper against upstream's, then SmolLM2
  with two PEFT adapters through an engine built from every Phase 11 piece,
  greedy tokens equal to transformers + peft's) runs on the solved copy
  only, for the same reason; the reference engine's LoRA tokens are proven
  against transformers + peft by tests/test_lora_engine.py.
- Lab 07.4 (a tiny hybrid Ministral through an engine built from every Phase
  07 piece, greedy tokens equal to transformers') runs on the solved copy
  only, for the same reason; the reference engine's hybrid tokens are proven
  against transformers' by tests/test_hybrid_model.py.
- Lab 15.4 (SmolLM2 through an engine built from every Phase 15 piece: a
  fresh engine skips the prefill a first one stored, greedy tokens equal a
  connector-less run's and transformers') runs on the solved copy only, for
  the same reason; the reference engine's stored-prefix runs are proven by
  tests/test_example_connector.py.
- Lab 17.4 (the tiny Llama at TP=2, and SmolLM2 at TP=3 in the deep tier,
  through an engine whose executor and workers run every Phase 17 piece,
  greedy tokens equal to TP=1 and transformers') runs on the solved copy
  only, for the same reason; the reference engine's TP runs are proven
  against transformers by tests/test_tensor_parallel.py.

What runs elsewhere (``PROVEN_ELSEWHERE``): Lab 19.3 has no region of its
own; it serves the student's code of every phase as one engine beside the
reference's server (minutes a run). tests/test_capstone.py proves it honest
on its own, in the fast tier: the solved copy answers as the reference does
and untouched starters fail the run. The three runs here grade
Phase 19's other labs.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mini_vllm.grading import regions as R

pytestmark = pytest.mark.slow
PHASES = R.phases()
# Labs left out of the reference's run: the solved copy's run proves them
# (see the module docstring).
SOLVED_COPY_ONLY = {
    "03": "03.7",
    "07": "07.4",
    "08": "08.4",
    "10": "10.4",
    "11": "11.4",
    "12": "12.4",
    "13": "13.4",
    "15": "15.4",
    "17": "17.4",
}
# Labs left out of all three runs: another test file proves them (see above).
PROVEN_ELSEWHERE = {"19": "19.3"}


def grade(phase: str, tmp_path: Path, *args: str) -> tuple[int, dict, str]:
    results = tmp_path / f"results-{phase}.json"
    if phase in PROVEN_ELSEWHERE:
        folder = lab_folders(phase, every=True)[PROVEN_ELSEWHERE[phase]]
        args = (*args, *([] if "--" in args else ["--"]), f"--deselect={folder}")
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


def lab_folders(phase: str, every: bool = False) -> dict[str, Path]:
    """{"03.7": phases/03-.../labs/lab-07-real-model}, relative to the repository;
    without ``every``, not the lab another file proves (PROVEN_ELSEWHERE)."""
    (folder,) = (R.REPO_ROOT / "phases").glob(f"{phase}-*")
    found = {
        f"{phase}.{int(p.name.split('-')[1])}": p.relative_to(R.REPO_ROOT)
        for p in (folder / "labs").glob("lab-*")
    }
    if not every:
        found.pop(PROVEN_ELSEWHERE.get(phase, ""), None)
    return found


def lab_dirs(phase: str) -> set[str]:
    return set(lab_folders(phase))


def upstream_counts(phase: str, stdout: str) -> tuple[int, int] | None:
    """(passed, in scope) from the line of upstream's own tests in ``stdout``;
    None for a phase without that line (which must then print none)."""
    from mini_vllm.oracle.upstream_suite.runner import LAB_FILES

    lines = [line for line in stdout.splitlines() if line.startswith("upstream's own unit tests")]
    if phase not in LAB_FILES:
        assert not lines, lines
        return None
    assert len(lines) == 1, stdout[-2000:]
    if importlib.util.find_spec("vllm") is None:  # `make test-no-upstream`: no pin to run them on
        assert "not run (they need the pinned vllm" in lines[0], lines[0]
        return None
    m = re.search(r": (\d+) of (\d+) in-scope tests pass on your code$", lines[0])
    assert m, lines[0]
    return int(m[1]), int(m[2])


def test_every_phase_with_regions_has_graded_labs():
    assert PHASES, "no lab regions found in mini_vllm/"
    for phase in PHASES:
        missing = set(R.labs_of(phase)) - lab_dirs(phase)
        assert not missing, f"labs with regions but no graded suite: {sorted(missing)}"


@pytest.mark.parametrize("phase", PHASES)
def test_reference_scores_full_marks(phase, tmp_path):
    left_out = {lab for p, lab in SOLVED_COPY_ONLY.items() if p == phase}
    deselect = [f"--deselect={lab_folders(phase)[lab]}" for lab in left_out]
    code, results, stdout = grade(
        phase, tmp_path, "--impl", "ref", "--no-upstream-tests", "--", *deselect
    )
    failed = [
        t["name"] + ": " + t["output"][:300] for t in results["tests"] if t["status"] != "passed"
    ]
    assert not failed, "\n".join(failed)
    assert set(results["labs"]) == lab_dirs(phase) - left_out, "a lab's suite collected no tests"
    assert results["score"] == results["max_score"] > 0 and code == 0, stdout[-2000:]
    assert "upstream's own unit tests" not in stdout, "--no-upstream-tests printed the line"


@pytest.mark.parametrize("phase", PHASES)
def test_untouched_starters_score_zero(phase, tmp_path):
    labs = tmp_path / "labs"
    subprocess.run(
        [sys.executable, "-m", "mini_vllm.grading", "generate", "--out", str(labs)],
        check=True,
        capture_output=True,
    )
    code, results, stdout = grade(phase, tmp_path, "--labs-dir", str(labs))
    passing = [t["name"] for t in results["tests"] if t["status"] == "passed"]
    assert not passing, f"these pass without any student code: {passing}"
    assert set(results["labs"]) == lab_dirs(phase)
    assert all(lab["points"] == 0 for lab in results["labs"].values())
    assert code != 0
    # Each failure must be an unwritten region of this phase, which also
    # proves the starters import and reach their regions.
    other = [
        t["name"] + ": " + t["output"][:300]
        for t in results["tests"]
        if f"Lab {phase}." not in t["output"]
    ]
    assert not other, "these fail for another reason than an unwritten region:\n" + "\n".join(other)
    if counts := upstream_counts(phase, stdout):
        passed, in_scope = counts
        assert passed < in_scope, f"upstream's tests pass on untouched starters: {stdout[-1000:]}"
    for lab, folder in lab_folders(phase).items():
        stated = readme_points(R.REPO_ROOT / folder / "README.md")
        total = results["labs"][lab]["total"]
        assert stated in (None, total), (
            f"{folder}/README.md says {stated} points; its suite grades {total:g}"
        )


def readme_points(readme: Path) -> int | None:
    """The "(N points)" a lab's README gives its suite, if it gives one."""
    found = re.findall(r"\((\d+) points\)", " ".join(readme.read_text().split()))
    assert len(set(found)) <= 1, f"{readme} gives its suite's points as {found}"
    return int(found[0]) if found else None


def solved_copy(tmp_path: Path) -> Path:
    labs = tmp_path / "solved"
    subprocess.run(
        [sys.executable, "-m", "mini_vllm.grading", "solve", "--out", str(labs)],
        check=True,
        capture_output=True,
    )
    return labs


def definitions(tree: ast.Module) -> dict[str, str]:
    """{"f": dump, "Class.method": dump} of a module's functions and methods."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            out[node.name] = ast.dump(node)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    out[f"{node.name}.{item.name}"] = ast.dump(item)
    return out


@pytest.mark.parametrize("phase", PHASES)
def test_solved_copy_is_the_reference_by_construction(phase, tmp_path):
    labs = solved_copy(tmp_path)
    compared = 0
    for reference in R.reference_modules(phase):
        rel = R.starter_relpath(phase, reference)
        solved_tree = ast.parse((labs / rel).read_text())
        ours = definitions(ast.parse(reference.read_text()))
        for name, dump in definitions(solved_tree).items():
            assert name in ours, f"{rel}: {name} is not in {reference.name}"
            assert dump == ours[name], f"{rel}: {name} differs from the reference's"
            compared += 1
        for node in solved_tree.body:
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b) for b in node.bases]
                assert bases == [f"_reference.{node.name}"], f"{rel}: {node.name}{bases}"
    assert compared >= len(R.labs_of(phase)), f"only {compared} definitions compared"


@pytest.mark.deep
@pytest.mark.parametrize("phase", PHASES)
def test_solved_starters_score_full_marks(phase, tmp_path):
    labs = solved_copy(tmp_path)
    code, results, stdout = grade(phase, tmp_path, "--labs-dir", str(labs))
    failed = [
        t["name"] + ": " + t["output"][:300] for t in results["tests"] if t["status"] != "passed"
    ]
    assert not failed, "\n".join(failed)
    assert set(results["labs"]) == lab_dirs(phase), "a lab's suite collected no tests"
    assert results["score"] == results["max_score"] > 0 and code == 0, stdout[-2000:]
    if counts := upstream_counts(phase, stdout):
        passed, in_scope = counts
        assert passed == in_scope > 0, stdout[-1000:]
