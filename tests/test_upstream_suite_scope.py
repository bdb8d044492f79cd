"""scope.toml of ``make upstream-tests`` keeps up with the phases that exist.

An upstream test is out of scope only for a feature the course has not taught
yet (a phase still to come), a feature it leaves out, or a difference kept on
purpose (UPSTREAM_PIN.md). Once the phase an "out" entry waits for exists, the
entry must be re-decided: this test fails while one still names it.
Needs neither the pinned vllm nor upstream's tests (it reads scope.toml only).
"""

from __future__ import annotations

import re
from pathlib import Path

from mini_vllm.oracle.upstream_suite.runner import LAB_FILES, load_scope, selects

REPO = Path(__file__).resolve().parents[1]
EXISTING = {p.name[:2] for p in (REPO / "phases").glob("[0-9][0-9]-*")}
# An entry naming an existing phase may stay out for these reasons only.
KEPT_OUT = ("UPSTREAM_PIN.md", "leaves out", "not in the course plan")


def named_phases(reason: str) -> set[str]:
    """The phase numbers a reason names: "Phase 08", "Phases 07, 17", "(Phase 00; Phase 07)"."""
    found = set()
    for group in re.findall(r"Phases? (\d\d(?:(?:, | and )\d\d)*)", reason):
        found |= set(re.findall(r"\d\d", group))
    return found


def test_no_out_entry_waits_for_a_phase_that_exists():
    stale = [
        f"{test}: {reason}"
        for test, (inside, reason) in load_scope().items()
        if not inside
        and named_phases(reason) & EXISTING
        and not any(kept in reason for kept in KEPT_OUT)
    ]
    assert not stale, (
        f"these out-of-scope tests wait for a phase that exists now ({sorted(EXISTING)}): "
        "bring them in, or say which feature the course leaves out or which difference "
        "UPSTREAM_PIN.md keeps:\n" + "\n".join(stale)
    )


def test_every_phase_line_selects_in_scope_tests():
    """Each phase's line counts some in-scope test, and a "file::test" selector
    names a test scope.toml still has in scope (a file may hold none yet)."""
    inside = [test for test, (kept, _) in load_scope().items() if kept]
    for phase, selectors in LAB_FILES.items():
        assert phase in EXISTING, f"LAB_FILES names phase {phase}, which has no folder"
        chosen = [test for test in inside if any(selects(s, test) for s in selectors)]
        assert chosen, f"phase {phase}: LAB_FILES selects no in-scope test in scope.toml"
        for selector in selectors:
            if "::" in selector:
                assert any(selects(selector, test) for test in inside), (
                    f"phase {phase}: {selector!r} selects no in-scope test in scope.toml"
                )
