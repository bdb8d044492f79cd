"""Fixtures shared by Phase 15's graded suites.

- ``up``: the pinned upstream's scheduler backend (mini_vllm/oracle/upstream.py),
  whose ``Scheduler`` the scheduler-side labs run beside yours, each with the
  same deterministic fake connector (mini_vllm/oracle/fake_connector.py).

Each lab folder may add fixtures of its own in its own ``conftest.py``.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def up():
    from mini_vllm.oracle import upstream

    return upstream
