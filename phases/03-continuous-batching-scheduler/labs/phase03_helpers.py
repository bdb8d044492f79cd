"""Helpers shared by Labs 03.1-03.3, which grade regions inside ``schedule()``.

Each lab has its own ``explain(error)``: it turns an error that a broken
region trips inside the reference's own code (an end-of-step assert, the
KV cache manager) into a sentence about the rule that region broke, or
returns None for errors it does not know. ``Stepper`` applies it wherever
a test runs ``schedule()``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import mini_vllm.testing as mini
from mini_vllm.grading.checks import lab_settings
from mini_vllm.oracle.workload import Stalled, run_workload

REPO_ROOT = Path(__file__).resolve().parents[3]
SCHEDULER = "mini_vllm/core/sched/scheduler.py"
KV_CACHE_MANAGER = "mini_vllm/core/kv_cache_manager.py"


def reference_text(text: str, path: str) -> str:
    """``text``, checked to be in the reference file ``path``.

    The explain() functions key on the reference's own source lines and error
    messages. Each key goes through here when its suite is collected, so if
    the reference's text changes the suite fails loudly, naming the key,
    instead of silently dropping the explanation."""
    if text not in (REPO_ROOT / path).read_text():
        raise LookupError(
            f"explain() keys on {text!r}, which {path} no longer holds: update the "
            "suite's explain() to the reference's new text"
        )
    return text


# No explain phase (it traces every line: slow on a broken scheduler), no database.
PROPERTY = lab_settings(60, shrink=True)

TOKEN = 1000  # what the fake model samples (never EOS, never a stop token)


class Stepper:
    """``schedule()`` and one engine step, failing with ``explain``'s message."""

    def __init__(self, explain, errors=(AssertionError, ValueError)):
        self.explain = explain
        self.errors = errors

    def explained(self, cls):
        """The class under grade, raising explain()'s message on the errors it knows."""
        explain, errors = self.explain, self.errors

        class Explained(cls):
            def schedule(self):
                try:
                    return super().schedule()
                except errors as e:
                    if (message := explain(e)) is None:
                        raise
                    raise AssertionError(message) from e

        Explained.__name__ = Explained.__qualname__ = cls.__name__
        return Explained

    def schedule(self, sched, label: str):
        """``sched.schedule()``; an error explain() knows fails the test naming the step."""
        try:
            return sched.schedule()
        except self.errors as e:
            if (message := self.explain(e)) is None:
                raise
            pytest.fail(f"{label}: {message}", pytrace=False)

    def step(self, sched, label: str):
        """One engine step: schedule(), a fake model, update_from_output()."""
        out = self.schedule(sched, label)
        sched.update_from_output(out, mini.make_model_runner_output(sched, out, lambda r: TOKEN))
        return out


def ids(reqs) -> list[str]:
    return [r.request_id for r in reqs]


def bounded(workload, max_steps: int):
    """The generated workload, failing after ``max_steps`` steps instead of 20000."""
    return dataclasses.replace(workload, max_steps=max_steps)


def run_checked(cls, workload, endless_hint: str) -> None:
    """Run a generated workload on ``cls`` (whose schedule() checks the rules);
    a workload that stalls or never finishes fails the test with ``endless_hint``."""
    try:
        run_workload(
            mini, workload, scheduler=mini.create_scheduler(**workload.config, scheduler_cls=cls)
        )
    except Stalled as e:
        pytest.fail(f"{e}: {endless_hint}", pytrace=False)
    except RuntimeError as e:
        if "did not finish" not in str(e):
            raise
        pytest.fail(f"{e}: {endless_hint}", pytrace=False)
