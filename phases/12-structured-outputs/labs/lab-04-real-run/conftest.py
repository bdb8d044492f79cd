"""Lab 12.4's fixtures (helpers: ../phase12_run_helpers.py).

- ``smollm2_run``: one engine run shared by the lab's tests: SmolLM2 through
  an engine built from your whole Phase 12 (every region yours, as the
  ``phase`` marker gives it), greedy, every prompt held to one JSON schema;
- ``transformers_check``: transformers' logits on the engine's sequences,
  masked by fresh xgrammar matchers walked along the engine's tokens.
"""

from __future__ import annotations

import time

import pytest


@pytest.fixture(scope="module")
def smollm2_run():
    """(the run, your Phase 12 modules). Module-scoped, so the engine runs
    once for the lab's tests: your code is loaded here as the ``impl``
    fixture loads it for a ``phase`` test (mini_vllm.grading.impl.load)."""
    from phase12_run_helpers import generate, plug_into_engine, smollm2_engine

    from mini_vllm.grading import impl as impl_mod

    impl = impl_mod.load("12")
    with pytest.MonkeyPatch.context() as monkeypatch:
        plug_into_engine(impl, monkeypatch)
        start = time.perf_counter()
        engine = smollm2_engine(impl.scheduler.Scheduler)
        load_seconds = time.perf_counter() - start
        core = engine.engine_core
        assert type(core.scheduler) is impl.scheduler.Scheduler, (
            "the engine must run your Scheduler"
        )
        assert (
            type(core.structured_output_manager) is impl.structured_output.StructuredOutputManager
        ), "the engine must run your StructuredOutputManager"
        run = generate(engine)
    run.stats["load_seconds"] = load_seconds
    return run, impl


@pytest.fixture(scope="module")
def transformers_check(smollm2_run):
    """(logits per prompt, a fresh-matcher factory, seconds): transformers'
    teacher-forced logits on the engine's sequences."""
    from phase12_run_helpers import (
        schema_matcher_factory,
        teacher_forced_logits,
        transformers_smollm2,
    )

    run, _ = smollm2_run
    start = time.perf_counter()
    hf = transformers_smollm2()
    logits = teacher_forced_logits(hf, run)
    return logits, schema_matcher_factory(run.tokenizer), time.perf_counter() - start
