"""Checks of an aging rule that Lab 09.2's suite and the project's tests share.

``watching(cls)`` wraps a scheduler class so that every ``schedule()`` is
checked against the two promises of the aging rule in
``mini_vllm/core/sched/aging.py``, watched from outside (the checker keeps
its own clock and its own record of when each request started waiting):

1. the bound: once a request has waited ``max_wait_steps`` steps, nobody who
   started waiting after it is admitted before it;
2. priority when there is room: a request admitted without having waited
   that long goes before every request left waiting, which must then be
   later in upstream's ``(priority, arrival_time, request_id)`` order and
   not promoted either.

A step's admissions are read from ``self.running`` (admitted requests are
appended in admission order); waiting requests from ``self.requests``. A
broken promise raises ``AssertionError`` naming the step, the two requests
and their waits.
"""

from __future__ import annotations

from hypothesis import strategies as st

from mini_vllm.oracle.strategies import scheduler_configs
from mini_vllm.oracle.workload import RequestSpec, Workload
from mini_vllm.request import RequestStatus

WAITING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


def key(request) -> tuple:
    """Upstream's PRIORITY order (vllm/v1/request.py:301)."""
    return (request.priority, request.arrival_time, request.request_id)


def with_bound(cls: type, max_wait_steps: int) -> type:
    """``cls`` with another stated bound."""
    return type(f"{cls.__name__}_{max_wait_steps}", (cls,), {"max_wait_steps": max_wait_steps})


def watching(cls: type) -> type:
    """``cls``, checked at every step against the bound it states (``max_wait_steps``)."""

    class Watched(cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.watch_step = 0
            self.entered: dict[str, int] = {}  # request id -> step it started waiting
            self.admitted_at: dict[str, list[int]] = {}

        def add_request(self, request):
            super().add_request(request)
            self.entered[request.request_id] = self.watch_step

        def schedule(self):
            t = self.watch_step
            waiting = [r for r in self.requests.values() if r.status in WAITING]
            before = {r.request_id for r in self.running}
            out = super().schedule()
            admitted = [r for r in self.running if r.request_id not in before]
            for request in admitted:
                self.admitted_at.setdefault(request.request_id, []).append(t)
            check_step(t, self.max_wait_steps, self.entered, waiting, admitted)
            for req_id in out.preempted_req_ids or ():
                self.entered[req_id] = t  # it starts waiting again
            self.watch_step += 1
            return out

    Watched.__name__ = Watched.__qualname__ = cls.__name__
    return Watched


def check_step(t: int, bound: int, entered: dict, waiting: list, admitted: list) -> None:
    """The two promises for step ``t`` (see the module docstring)."""
    admitted_ids = {r.request_id for r in admitted}
    left = [r for r in waiting if r.request_id not in admitted_ids]

    def waited(r) -> int:
        return t - entered[r.request_id]

    def promoted(r) -> bool:
        return waited(r) >= bound

    for s in left:
        if not promoted(s):
            continue
        for r in admitted:
            if not promoted(r) or entered[r.request_id] > entered[s.request_id]:
                raise AssertionError(
                    f"step {t}: {s.request_id} had waited {waited(s)} steps (the bound, "
                    f"max_wait_steps, is {bound}) since step {entered[s.request_id]}, yet "
                    f"{r.request_id}, waiting only since step {entered[r.request_id]}, was "
                    f"admitted before it. Once a request has waited max_wait_steps steps, "
                    "nobody who started waiting after it may go first."
                )
    for r in admitted:
        if promoted(r):
            continue
        for s in left:
            if promoted(s) or key(s) < key(r):
                raise AssertionError(
                    f"step {t}: {r.request_id} (priority {r.priority}, arrival "
                    f"{r.arrival_time}, waited {waited(r)} of {bound} steps: not promoted) "
                    f"was admitted while {s.request_id} (priority {s.priority}, arrival "
                    f"{s.arrival_time}, waited {waited(s)}) stayed waiting. Below the bound, "
                    "upstream's (priority, arrival_time) order decides: the better key first."
                )
    # Promoted first, by the step each started waiting (ties: either order), then the
    # rest by key.
    order = [(0, entered[r.request_id]) if promoted(r) else (1, key(r)) for r in admitted]
    if order != sorted(order):
        raise AssertionError(
            f"step {t}: admitted in the order {[r.request_id for r in admitted]}; the queue's "
            "order is promoted requests first (longest-waiting first), then the rest in "
            "(priority, arrival_time) order."
        )


@st.composite
def contended_workloads(draw, policy: str = "priority") -> Workload:
    """Workloads where requests queue: few seats, arrivals over many steps,
    priorities 0-3; every configuration is one upstream accepts."""
    config = draw(scheduler_configs())
    config["policy"] = policy
    config["max_num_seqs"] = draw(st.sampled_from([1, 2, 3, 4]))
    config["max_num_batched_tokens"] = max(config["max_num_batched_tokens"], config["max_num_seqs"])
    max_model_len = config["max_model_len"]
    n = draw(st.integers(2, 24))
    requests = []
    for i in range(n):
        length = draw(st.integers(1, max(1, min(48, max_model_len - 2))))
        requests.append(
            RequestSpec(
                req_id=f"req-{i}",
                prompt_token_ids=[draw(st.integers(1, 999))] * length,
                max_tokens=draw(st.integers(1, 12)),
                arrive_step=draw(st.integers(0, 40)),
                priority=draw(st.integers(0, 3)),
                ignore_eos=True,
                abort_step=draw(st.none() | st.none() | st.none() | st.integers(0, 40)),
            )
        )
    return Workload(name="contended", config=config, requests=requests)
