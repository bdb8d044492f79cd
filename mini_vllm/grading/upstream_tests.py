"""The extra line of ``make check-phase-NN``: upstream's own tests.

Where a phase's labs hollow out modules that upstream's unit tests reach
(Phase 02: the KV-cache pieces; 03: the scheduler; 05: the input batch; 06:
the sampler; 07: KV-cache groups and sliding windows; 08: the n-gram proposer
and drafts in the scheduler; 12: the grammar wait; 14: the async scheduler:
``runner.LAB_FILES``), the grader also
runs upstream's own in-scope unit tests for those modules on the student's code
(``mini_vllm.oracle.upstream_suite``) and reports the count beside the score.
The line is information, not points: the score alone decides the exit code.
"""

from __future__ import annotations

import importlib.util

from mini_vllm.oracle.upstream_suite.runner import LAB_FILES, phase_line


def upstream_tests_line(phase: str, impl: str, hung: bool = False) -> str | None:
    """The line for ``phase``, None for a phase without one. Not run after a
    graded test hung: upstream's tests would run into the same loop."""
    if phase not in LAB_FILES:
        return None
    if hung:
        return "upstream's own unit tests: not run (a graded test hung: fix that first)"
    if importlib.util.find_spec("vllm") is None:
        return "upstream's own unit tests: not run (they need the pinned vllm: `make upstream`)"
    try:
        return phase_line(phase, impl)
    except RuntimeError as error:
        return f"upstream's own unit tests: not run ({error})"
