"""Fixtures shared by Phase 13's graded suites (helpers: phase13_helpers.py).

- ``up``: the pinned upstream's scheduler backend (mini_vllm/oracle/upstream.py),
  whose ``Scheduler`` and ``EncoderCacheManager`` Labs 13.1 and 13.2 run
  beside yours.

Each lab folder may add fixtures of its own in its own ``conftest.py``.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def up():
    from mini_vllm.oracle import upstream

    return upstream
