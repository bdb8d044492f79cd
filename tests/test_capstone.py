"""Phase 19's whole engine: the student's code of every phase assembled into
the reference's modules (mini_vllm/grading/assemble.py), served, and graded
against the reference's server (mini_vllm/grading/capstone.py).

Fast tier: the assembly at no serving cost (the starters' holes reach every
module, and a served module runs them), then the honesty checks on real runs
against one reference server shared by the module: the solved copy answers
the reference's requests as the reference does, and the untouched starters
fail the run (their engine stops at the first hole it reaches, while
starting: one server start, no bisection); and the rule that each concurrent
stream equals the reference's answer sent alone. Deep tier: a solved copy
with one planted Phase 04 bug is named by the bisection as Phase 04, and one
with a planted Phase 08 proposer bug (seen only in the speculative-decoding
counters) as Phase 08 (a server start for each phase it tries).
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from planted_bugs import PLANTS, apply, solved_starter

from mini_vllm.grading import assemble, capstone
from mini_vllm.grading import regions as R

REPO = Path(__file__).resolve().parents[1]
STARTERS = REPO / R.LABS_PACKAGE


@pytest.fixture(scope="module")
def solved(tmp_path_factory) -> Path:
    labs = tmp_path_factory.mktemp("capstone") / "solved"
    subprocess.run(
        [sys.executable, "-m", "mini_vllm.grading", "solve", "--out", str(labs)],
        check=True,
        capture_output=True,
    )
    return labs


@pytest.fixture(scope="module")
def served() -> dict:
    """The reference's transcript, and the untouched starters' run, started in
    a thread beside it: the starters' engine stops at its first hole while it
    starts, so its start overlaps the reference server's (one server start
    each; no bisection)."""
    with ThreadPoolExecutor(1) as pool:
        starters = pool.submit(capstone.run_student, STARTERS, R.phases())
        with capstone.serve() as url:
            reference = capstone.transcript(url)
        return {"reference": reference, "starters": starters.result()}


@pytest.fixture(scope="module")
def reference(served) -> dict:
    return served["reference"]


def test_solved_copy_assembles_into_the_reference_source(solved):
    every = R.phases()
    for path in R.reference_modules():
        assert assemble.assembled_source(path, solved, every) == path.read_text(), path


def test_starters_assemble_into_other_source_in_every_module():
    every = R.phases()
    same = [
        str(path)
        for path in R.reference_modules()
        if assemble.assembled_source(path, STARTERS, every) == path.read_text()
    ]
    assert not same, f"the starters' holes did not reach: {same}"


def test_phases_are_read_from_the_environment():
    assert assemble.parse_phases("all") == R.phases()
    assert assemble.parse_phases("3,00") == ["00", "03"]
    with pytest.raises(ValueError, match="MINI_VLLM_STUDENT_PHASES: no lab regions in phase"):
        assemble.parse_phases("99")


def _run_with(phases: str, code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, MINI_VLLM_STUDENT_PHASES=phases, MINI_VLLM_LABS_DIR=str(STARTERS))
    script = f"from mini_vllm.grading.assemble import install_from_env\ninstall_from_env()\n{code}"
    return subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, cwd=REPO
    )


def test_the_hook_puts_the_students_code_into_the_reference_module():
    # Lab 00.2's function, imported from the reference's module, is the starter's hole.
    call = (
        "from mini_vllm.kv_cache_interface import FullAttentionSpec\n"
        "import torch\n"
        "FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=64, dtype=torch.float32)"
        ".page_size_bytes\n"
    )
    run = _run_with("00", call)
    assert "NotImplementedError: Lab 00.2" in run.stderr, run.stderr
    # The same module with another phase's code chosen is the reference's.
    assert _run_with("03", call).returncode == 0


def test_solved_copy_answers_as_the_reference(solved, reference):
    assert capstone.grade(solved, reference) is None


def test_untouched_starters_fail_the_run(served):
    got = served["starters"]
    why = got if isinstance(got, str) else capstone.compare(served["reference"], got)
    # The first hole the engine reaches (Lab 17.2's, building the model, since Phase 17).
    assert why is not None and "NotImplementedError: Lab " in why, why


@pytest.mark.deep
def test_bisection_names_the_phase_of_a_planted_bug(solved, reference, tmp_path):
    plant = next(p for p in PLANTS if p.path == "mini_vllm/attention/backends/torch_attn.py")
    labs = tmp_path / "planted"
    subprocess.run(["cp", "-r", str(solved), str(labs)], check=True)
    rel, _ = solved_starter(plant)
    apply(plant, labs / rel)
    verdict = capstone.bisect(labs, reference)
    assert verdict.startswith(f"Phase {plant.phase} is the first"), verdict


def test_compare_wants_each_concurrent_stream_equal_to_the_reference_alone():
    # A reference whose third stream answered differently beside the others:
    # a student matching it entry by entry still differs from the lone answer.
    alone = [(f"text {i}", [1], [i, i], "length") for i in range(len(capstone.CONCURRENT))]
    beside = [*alone[:2], ("other", [1], [7, 7], "length"), alone[3]]
    reference = {"four prompts, one at a time": alone, "four concurrent streams": beside}
    why = capstone.compare(reference, dict(reference))
    assert why is not None and why.startswith(f"{capstone.CONCURRENT[2]!r} streamed beside"), why
    same = {**reference, "four concurrent streams": alone}
    assert capstone.compare(same, dict(same)) is None


@pytest.mark.deep
def test_bisection_names_phase_08_for_a_planted_proposer_bug(solved, reference, tmp_path):
    # Drafting after the latest n-gram match keeps greedy tokens (drafts are
    # verified) but changes what is drafted: only the served run's speculative
    # counters can tell, and the bisection must still name Phase 08.
    plant = next(p for p in PLANTS if p.path == "mini_vllm/spec_decode/ngram_proposer.py")
    labs = tmp_path / "planted"
    subprocess.run(["cp", "-r", str(solved), str(labs)], check=True)
    rel, _ = solved_starter(plant)
    apply(plant, labs / rel)
    verdict = capstone.bisect(labs, reference)
    assert verdict.startswith("Phase 08 is the first"), verdict
    assert "speculative decoding" in verdict, verdict
