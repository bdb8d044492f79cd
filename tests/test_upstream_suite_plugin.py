"""The plugin that runs upstream's unit tests on a student's starters reaches
the student's code, even through a reference function the starter re-exports.

Needs neither the pinned vllm nor upstream's tests: it builds the adapter
upstream's test_sampler.py gets for ``Sampler`` and calls it directly.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from mini_vllm.oracle.upstream_suite import plugin


@pytest.fixture
def untouched_phase_06(tmp_path, monkeypatch):
    labs = tmp_path / "labs"
    subprocess.run(
        [sys.executable, "-m", "mini_vllm.grading", "generate", "--out", str(labs)],
        check=True,
        capture_output=True,
    )
    monkeypatch.setenv("MINI_VLLM_LABS_DIR", str(labs))
    plugin._load_labs("06")
    plugin.adapter.cache_clear()
    yield
    plugin.LAB_MODULES.clear()
    plugin.adapter.cache_clear()


def test_upstream_apply_penalties_runs_the_students_penalties(untouched_phase_06):
    # The starter re-exports the reference's apply_all_penalties, which must
    # call the starter's apply_penalties (Lab 06.1), not the reference's.
    sampler = plugin.adapter("vllm.v1.sample.sampler", "Sampler")()
    metadata = SimpleNamespace(
        no_penalties=False,
        prompt_token_ids=torch.zeros((1, 1), dtype=torch.int64),
        presence_penalties=torch.ones(1),
        frequency_penalties=torch.zeros(1),
        repetition_penalties=torch.ones(1),
    )
    with pytest.raises(NotImplementedError, match="Lab 06.1"):
        sampler.apply_penalties(torch.zeros((1, 8)), metadata, [[1]])
