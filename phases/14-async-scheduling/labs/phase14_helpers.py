"""Helpers shared by Phase 14's graded suites: your scheduler built the way
the engine builds it, hand-made model outputs, and for Lab 14.2 an engine
core whose worker and model are recorders, and a watchdog so a batch queue
that never returns fails the test instead of hanging it.

(Imported by name from the suites: this folder is on sys.path because pytest
puts the folder of ``conftest.py`` there.)
"""

from __future__ import annotations

import ctypes
import threading
from collections import deque

import pytest

import mini_vllm.testing as mini
from mini_vllm.grading.checks import written  # noqa: F401 (the lab tests import it from here)
from mini_vllm.outputs import ModelRunnerOutput


def async_scheduler(cls, **config):
    """An AsyncScheduler of class ``cls`` (yours or the reference's) over a small KV cache."""
    return mini.create_scheduler(scheduler_cls=cls, async_scheduling=True, **config)


def runner_output(scheduler_output, tokens: dict[str, list[int]]) -> ModelRunnerOutput:
    """A model output for ``scheduler_output``: ``tokens[req_id]`` for the
    requests named, no token for the others (mid-prefill)."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[tokens.get(r, []) for r in req_ids],
    )


# ------------------------------------------------------------------ Lab 14.2


class StepFuture:
    """What the recording worker hands back for one submitted step: runs the
    step only when ``result()`` is called (a step "still running" until it is
    waited on, unless the test says it is already done)."""

    def __init__(self, log: list, step: int, fn, arg, done: bool) -> None:
        self.log, self.step, self.fn, self.arg, self._done = log, step, fn, arg, done
        self.taken = False

    def done(self) -> bool:
        return self._done

    def result(self, timeout=None):
        if self.taken:
            raise AssertionError(f"result() of step {self.step} was taken twice")
        self.taken = True
        self.log.append(("result", self.step))
        return self.fn(self.arg)


class RecordingWorker:
    """Stands for the one worker thread: ``submit`` records the call and
    returns a ``StepFuture``; ``in_flight`` counts the steps submitted whose
    result was not taken yet, ``most_in_flight`` the largest count seen."""

    def __init__(self, log: list, done: bool = False) -> None:
        self.log, self.done = log, done
        self.futures: list[StepFuture] = []
        self.most_in_flight = 0

    def submit(self, fn, arg):
        step = len(self.futures) + 1
        self.log.append(("submit", step))
        future = StepFuture(self.log, step, fn, arg, self.done)
        self.futures.append(future)
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        return future

    @property
    def in_flight(self) -> int:
        return sum(not f.taken for f in self.futures)


class FakeRunner:
    """The model: each request that samples in a step gets the token for its
    output index from ``next_token(request)`` when the step is run."""

    def __init__(self, scheduler, next_token) -> None:
        self.scheduler, self.next_token = scheduler, next_token
        self.outputs: dict[int, object] = {}  # id(scheduler_output) -> the output
        # id(scheduler_output) -> the requests that sample in it (decided
        # right after schedule(): a later schedule() moves the prefill on).
        self.sampling: dict[int, list[str]] = {}

    def execute_model(self, scheduler_output):
        sampled = {}
        for req_id in self.sampling[id(scheduler_output)]:
            if (request := self.scheduler.requests.get(req_id)) is not None:
                sampled[req_id] = [self.next_token(request)]
        out = runner_output(scheduler_output, sampled)
        self.outputs[id(scheduler_output)] = out
        return out


def recording_core(engine_core_cls, scheduler, next_token, done: bool = False):
    """An ``engine_core_cls`` (yours) with the real AsyncScheduler ``scheduler``
    and a recording worker and model: ``core.log`` lists, in order, each
    ``("schedule", n)``, ``("submit", n)``, ``("result", n)`` and
    ``("update", n)`` (n: the step's number, by schedule order)."""
    log: list = []
    core = object.__new__(engine_core_cls)  # no model, no KV cache to build
    numbers: dict[int, int] = {}  # id(scheduler_output) -> step number
    core.log, core.numbers = log, numbers

    class Recorded(type(scheduler)):
        def schedule(self):
            out = super().schedule()
            numbers[id(out)] = len(numbers) + 1
            core.model_runner.sampling[id(out)] = [
                r for r in out.num_scheduled_tokens if not self.requests[r].is_prefill_chunk
            ]
            log.append(("schedule", numbers[id(out)]))
            return out

        def update_from_output(self, scheduler_output, model_runner_output):
            n = numbers.get(id(scheduler_output))
            log.append(("update", n))
            runner = core.model_runner
            if runner.outputs.get(id(scheduler_output)) is not model_runner_output:
                raise AssertionError(
                    f"update_from_output got step {n}'s scheduler output with another "
                    "step's model output: pair each with its own (the queue holds them together)."
                )
            return super().update_from_output(scheduler_output, model_runner_output)

    scheduler.__class__ = Recorded
    core.scheduler = scheduler
    core.model_runner = FakeRunner(scheduler, next_token)
    core.worker = RecordingWorker(log, done)
    core.batch_queue_size = 2
    core.batch_queue = deque(maxlen=2)
    core.num_steps = core.num_preemptions = core.num_scheduled_tokens = 0
    return core


def within(seconds: float, fn, what: str):
    """``fn()`` on a watchdog thread; fails the test, naming ``what``, if it
    has not returned after ``seconds`` (a batch queue waiting on a step that
    will never end, or a loop that never ends). Its exceptions are re-raised here."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test thread
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True, name="phase14-watchdog")
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        # Stop the stuck loop (best effort: it ends at its next Python line),
        # so that it does not go on taking CPU from the tests after this one.
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(thread.ident), ctypes.py_object(SystemExit)
        )
        pytest.fail(
            f"{what} did not return within {seconds:g} s: step_with_batch_queue is stuck "
            "(waiting on a step that was never submitted, or looping).",
            pytrace=False,
        )
    if "error" in box:
        if isinstance(box["error"], NotImplementedError):
            pytest.fail(f"{box['error']}: a lab region is not written yet.", pytrace=False)
        raise box["error"]
    return box.get("value")
