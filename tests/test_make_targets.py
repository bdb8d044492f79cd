"""The Makefile's lint, test and jupyter targets, read with ``make -n`` (nothing runs)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def dry_run(target: str) -> list[str]:
    out = subprocess.run(
        ["make", "-n", "--always-make", target],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "MINI_VLLM_TIER"},  # the Makefile's own
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_make_lint_runs_ruff_check_and_format_check():
    lines = dry_run("lint")
    assert ".venv/bin/ruff check ." in lines
    assert ".venv/bin/ruff format --check ." in lines


def test_make_test_lints_before_pytest():
    lines = dry_run("test")
    lint = lines.index(".venv/bin/ruff check .")
    pytest_runs = [i for i, line in enumerate(lines) if "-m pytest" in line]
    assert pytest_runs and lint < pytest_runs[0], lines


def test_make_jupyter_installs_registers_then_opens_notebooks():
    lines = dry_run("jupyter")
    install = lines.index(".venv/bin/pip install -e '.[dev,jupyter]'")
    kernel = next(i for i, line in enumerate(lines) if "-m ipykernel install" in line)
    lab = lines.index(".venv/bin/jupyter lab notebooks/")
    assert install < kernel < lab, lines


@pytest.mark.parametrize("target, tier", [("test", "fast"), ("test-deep", "deep")])
def test_each_tier_runs_tests_notebooks_and_upstreams_own_tests(target, tier):
    lines = dry_run(target)
    (run,) = [line for line in lines if "-m pytest" in line]
    assert f"MINI_VLLM_TIER={tier} " in run and "--nbmake tests notebooks" in run, run
    assert "MINI_VLLM_REQUIRE_UPSTREAM=1" in run, run
    (suite,) = [line for line in lines if "-m mini_vllm.oracle.upstream_suite" in line]
    assert f"MINI_VLLM_TIER={tier} " in suite, suite  # the slow upstream test runs in deep only
