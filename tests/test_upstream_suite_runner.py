"""How ``make upstream-tests`` splits its pytest runs.

Upstream's tests/v1/logits_processors/test_correctness.py forks a child for
each test. Run in the same pytest as files whose tests used torch on the CPU
first, the child hung on a lock (0 s of CPU, in futex_wait) and the suite never
finished; in a pytest of its own it passes. tests/v1/sample/test_rejection_sampler.py
needs Triton's interpreter, which the other files must not see. Needs neither
the pinned vllm nor upstream's tests: the pytest runs are recorded, not started.
"""

from __future__ import annotations

import pytest

from mini_vllm.oracle.upstream_suite import runner

FORKING = "tests/v1/logits_processors/test_correctness.py"
KERNELS = "tests/v1/sample/test_rejection_sampler.py"


def test_files_that_fork_or_need_the_interpreter_run_in_a_pytest_of_their_own(monkeypatch):
    runs = []

    def record(target, node_ids, extra, timeout, env=None):
        runs.append((list(node_ids), env or {}))
        return {node: "passed" for node in node_ids}

    monkeypatch.setattr(runner, "_run_pytest", record)
    nodes = [
        "tests/v1/sample/test_sampler.py::test_sampler_min_p",
        f"{FORKING}::test_logitsprocs[logitsprocs_under_test0-50-cpu:0]",
        "tests/v1/core/test_scheduler.py::test_add_requests",
        f"{KERNELS}::test_perfect_match",
    ]
    results = runner.run_pytest("vllm", nodes)
    assert {FORKING, KERNELS} <= set(runner.ALONE) and {FORKING, KERNELS} <= set(runner.FILES)
    assert ([nodes[0], nodes[2]], {}) in runs, runs
    assert ([nodes[1]], {}) in runs, runs
    assert ([nodes[3]], {"TRITON_INTERPRET": "1"}) in runs, runs
    assert set(results) == set(nodes)


HANGS = """
import time


def test_hangs():
    time.sleep(600)
"""


def test_a_run_that_hangs_is_stopped_and_named(monkeypatch, tmp_path):
    """A pytest run past its limit is killed (with everything it started) and
    the error names the target and the file; without the limit this test
    would wait the 600 s its test sleeps."""
    (tmp_path / "test_hangs.py").write_text(HANGS)
    monkeypatch.setattr(runner, "tests_root", lambda: tmp_path)
    stopped = r"pytest against vllm stopped after 5 s.*test_hangs\.py"
    with pytest.raises(RuntimeError, match=stopped):
        runner._run_pytest("vllm", ["test_hangs.py::test_hangs"], (), 5.0)
