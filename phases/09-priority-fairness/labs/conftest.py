"""Fixtures shared by Phase 09's graded suites."""

from __future__ import annotations

import pytest

# Past this, hypothesis stops shrinking a failure and reports the smallest
# failing workload found so far, so a failing property ends within its time limit.
SHRINK_SECONDS = 10


@pytest.fixture
def short_shrink(monkeypatch):
    """Bound hypothesis's shrinking (see SHRINK_SECONDS)."""
    try:
        from hypothesis.internal.conjecture import engine

        monkeypatch.setattr(engine, "MAX_SHRINKING_SECONDS", SHRINK_SECONDS, raising=False)
    except ImportError:
        pass
