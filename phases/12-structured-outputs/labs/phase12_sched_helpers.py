"""Helpers for Lab 12.1's graded suite: a small scheduler driven by hand, with
grammar compiles the test finishes (or fails) when it chooses, and a
lockstep message that names the step, the request and the field.

A structured request here carries a real constraint (a regex, validated as
the input processor does), but its grammar is a ``Future`` the test holds,
as ``EngineCore.add_request``'s ``grammar_init`` leaves it: the scheduler
sees ``grammar`` None until the test completes the future with an
``AcceptingGrammar`` (mini_vllm/oracle/workload.py), or re-raised once the
test sets an exception on it.

(Imported by name from the suites: this folder is on sys.path because pytest
puts the folder of ``conftest.py`` there.)
"""

from __future__ import annotations

from concurrent.futures import Future

import pytest

import mini_vllm.testing as mini
from mini_vllm.grading.checks import written
from mini_vllm.grading.plugin import LabTimeout
from mini_vllm.oracle.workload import (  # noqa: F401 (lockstep_difference: the lab tests import it from here)
    AcceptingGrammar,
    lockstep_difference,
)
from mini_vllm.outputs import ModelRunnerOutput

SMALL = dict(
    block_size=4, num_blocks=64, max_num_batched_tokens=64, max_model_len=64, max_num_seqs=4
)
CONSTRAINT = {"regex": "[0-9]+"}
# What the fake model samples for every request that finished its prompt.
TOKEN = 1234


def make(impl, **config):
    """Your Scheduler over a small KV cache (``config`` overrides SMALL)."""
    return mini.create_scheduler(scheduler_cls=impl.scheduler.Scheduler, **{**SMALL, **config})


def request(req_id: str, arrival: float, priority: int = 0, structured: bool = False):
    """A request with an 8-token prompt; ``structured``: it waits for a grammar."""
    (req,) = mini.create_requests(
        1,
        req_ids=[req_id],
        prompt_token_ids=[[10 + int(arrival)] * 8],
        arrival_times=[arrival],
        priorities=[priority],
        max_tokens=20,
        block_size=SMALL["block_size"],
        structured_outputs=CONSTRAINT if structured else None,
    )
    return req


class Compile:
    """A grammar compile the test finishes: ``done()`` or ``fail()``."""

    def __init__(self, req) -> None:
        self.future: Future = Future()
        req.structured_output_request.grammar = self.future

    def done(self) -> None:
        self.future.set_result(AcceptingGrammar())

    def fail(self, message: str = "the compiler gave up") -> None:
        self.future.set_exception(RuntimeError(message))


def add(sched, req_id: str, arrival: float, priority: int = 0, compiling: bool = False):
    """Add a request; ``compiling``: a structured one whose compile is still
    running (returns (request, its Compile)), else a plain one (returns
    (request, None))."""
    req = request(req_id, arrival, priority, structured=compiling)
    job = Compile(req) if compiling else None
    written(sched.add_request, req)
    return req, job


def ids(queue) -> list[str]:
    """A waiting queue's request ids, in the order it would pop them."""
    if hasattr(queue, "_heap"):
        return [r.request_id for r in sorted(queue._heap)]
    return [r.request_id for r in queue]


def step(sched, n: int):
    """schedule() then update_from_output() with TOKEN for each request that
    finished its prompt; returns (SchedulerOutput, EngineCoreOutputs).
    ``n`` (the step's number) is for the messages."""
    try:
        out = written(sched.schedule)
    except LabTimeout as e:
        raise LabTimeout(
            f"{e}\nThat was inside your schedule() at step {n} (waiting {ids(sched.waiting)}, "
            f"skipped_waiting {ids(sched.skipped_waiting)}). Most often: a request passed over "
            "while its grammar compiles stays at the head of its queue (it must leave the queue "
            "for the step: pop it, then `continue`), so the waiting loop meets it forever."
        ) from None
    except (AssertionError, RuntimeError, IndexError, AttributeError, KeyError) as e:
        pytest.fail(
            f"step {n}: schedule() raised {type(e).__name__}: {e}. Waiting "
            f"{ids(sched.waiting)}, skipped_waiting {ids(sched.skipped_waiting)}, running "
            f"{[r.request_id for r in sched.running]}; statuses "
            f"{ {r: q.status.name for r, q in sched.requests.items()} }. (The admission code "
            "after your region takes only a WAITING or PREEMPTED request: a promoted request must "
            "be WAITING, a finished one must not come back to a queue.)",
            pytrace=False,
        )
    req_ids = list(out.num_scheduled_tokens)
    sampled = [
        [] if sched.requests[r].num_computed_tokens < sched.requests[r].num_tokens else [TOKEN]
        for r in req_ids
    ]
    result = written(
        sched.update_from_output,
        out,
        ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
        ),
    )
    return out, result


def scheduled(out) -> list[str]:
    return list(out.num_scheduled_tokens)
