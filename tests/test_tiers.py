"""mini_vllm/tiers.py: which count each tier runs, and a bad tier refused."""

import pytest

from mini_vllm.grading.checks import lab_settings
from mini_vllm.tiers import examples, tier


def test_unset_is_deep_so_a_students_grade_gets_the_full_count(monkeypatch):
    monkeypatch.delenv("MINI_VLLM_TIER", raising=False)
    assert tier() == "deep"
    assert examples(2000, 300) == 2000
    assert lab_settings(60).max_examples == 60


def test_fast_tier_counts(monkeypatch):
    monkeypatch.setenv("MINI_VLLM_TIER", "fast")
    assert examples(2000, 300) == 300
    assert lab_settings(60).max_examples == 15
    assert lab_settings(20).max_examples == 10  # never below 10


def test_a_named_variable_overrides_both_tiers(monkeypatch):
    monkeypatch.setenv("MINI_VLLM_LOCKSTEP_EXAMPLES", "7")
    for value in ("fast", "deep"):
        monkeypatch.setenv("MINI_VLLM_TIER", value)
        assert examples(2000, 300, "MINI_VLLM_LOCKSTEP_EXAMPLES") == 7


def test_an_unknown_tier_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv("MINI_VLLM_TIER", "fsat")
    with pytest.raises(ValueError, match=r"MINI_VLLM_TIER='fsat': expected one of"):
        tier()


def test_the_grader_refuses_an_unknown_tier_before_grading():
    import os
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "mini_vllm.grading", "check", "02.1", "--impl", "ref"],
        capture_output=True,
        text=True,
        env={**os.environ, "MINI_VLLM_TIER": "fsat"},
    )
    assert proc.returncode != 0
    assert proc.stderr.strip() == "MINI_VLLM_TIER='fsat': expected one of ('fast', 'deep')"
    assert "Score" not in proc.stdout
