"""The two test tiers: how many generated examples a property or a lockstep runs.

``MINI_VLLM_TIER=fast`` is what ``make test`` (and CI) runs: every test, at
smaller example counts (tests/planted_bugs.py grades three planted bugs a
phase at them).
``MINI_VLLM_TIER=deep`` is ``make test-deep``: the full counts, and the tests
marked ``deep`` (tests/conftest.py deselects those in the fast tier).

Unset, the tier is deep: a student's ``make check-phase-NN`` grades at the
full counts. tests/conftest.py sets ``fast`` for a bare ``pytest`` run.

No upstream counterpart: upstream vLLM splits its CI into pipelines, not
example counts.
"""

from __future__ import annotations

import os

TIERS = ("fast", "deep")


def tier() -> str:
    """``"fast"`` or ``"deep"``; any other value of MINI_VLLM_TIER is an error."""
    value = os.environ.get("MINI_VLLM_TIER", "deep")
    if value not in TIERS:
        raise ValueError(f"MINI_VLLM_TIER={value!r}: expected one of {TIERS}")
    return value


def examples(deep: int, fast: int, env: str | None = None) -> int:
    """The example count of this tier; ``env`` names a variable that, when
    set, overrides both (for a one-off longer run)."""
    if env and env in os.environ:
        return int(os.environ[env])
    return deep if tier() == "deep" else fast
