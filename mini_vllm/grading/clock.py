"""The time a test has had, not the time a busy machine kept it waiting.

A graded test's time limit catches a loop that never ends. Measured on the
wall clock, a correct test on a laptop running other work (load average 10
on 2 cores) can take six times as long and be reported as hung. So the
limits are measured on this clock: the wall clock minus the time every
thread of the process spent runnable but waiting for a CPU (the second
field of Linux's ``/proc/<pid>/task/<tid>/schedstat``). A test that
computes, sleeps or waits for I/O advances it as on a quiet machine; a
test held in the run queue does not. A ``while True`` advances it at the
wall clock's rate on a quiet machine, so a real hang is still reported at
the limit. Where schedstat cannot be read, the clock runs at the wall
clock's rate divided by the load average per core (at least 1).
"""

from __future__ import annotations

import os
import time


class TestClock:
    __test__ = False  # not a pytest test class

    def __init__(self, pid: int | None = None) -> None:
        self.pid = pid or os.getpid()
        self.restart()

    def restart(self) -> None:
        self.start = time.monotonic()
        self.base = self._waits() or {}  # {tid: ns waited} at the start
        self.last = dict(self.base)

    def _waits(self) -> dict[int, int] | None:
        """{thread id: ns spent waiting for a CPU}, None if it cannot be read."""
        try:
            tids = os.listdir(f"/proc/{self.pid}/task")
        except OSError:
            return None
        waits = {}
        for tid in tids:
            try:
                with open(f"/proc/{self.pid}/task/{tid}/schedstat") as f:
                    waits[int(tid)] = int(f.read().split()[1])
            except (OSError, ValueError, IndexError):
                continue  # a thread that just ended
        return waits or None

    def elapsed(self) -> float:
        """Seconds since ``restart``, less the time spent waiting for a CPU."""
        wall = time.monotonic() - self.start
        now = self._waits()
        if now is None:
            per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
            return wall / max(1.0, per_core)
        self.last.update(now)  # a thread that ended keeps its last reading
        waited = sum(ns - self.base.get(tid, 0) for tid, ns in self.last.items()) / 1e9
        return max(0.0, wall - waited)
