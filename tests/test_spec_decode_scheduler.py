"""Drafts in the scheduler, one rule per test (the lockstep against upstream
is tests/upstream/test_lockstep.py::test_spec_lockstep_with_upstream)."""

from __future__ import annotations

import pytest

import mini_vllm.testing as mini
from mini_vllm.config import SchedulerConfig, SpeculativeConfig, VllmConfig
from mini_vllm.outputs import DraftTokenIds


def test_speculative_config_fills_lookup_bounds_as_upstream():
    assert (SpeculativeConfig(num_speculative_tokens=2).prompt_lookup_min, 5) == (5, 5)
    only_max = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=3)
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (3, 3)
    only_min = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=2)
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (2, 2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2, "method": "eagle"}, "ngram"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "lookup"),
    ],
)
def test_bad_speculative_config_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig(**kwargs).verify()


def _decoding_request(sched, drafts):
    """One request past its prefill, holding ``drafts``."""
    (req,) = mini.create_requests(1, num_tokens=8, max_tokens=20, block_size=4)
    sched.add_request(req)
    out = sched.schedule()
    sched.update_from_output(out, mini.make_model_runner_output(sched, out, lambda r: 1001))
    sched.update_draft_token_ids(DraftTokenIds([req.request_id], [drafts]))
    return req


def test_drafts_are_scheduled_charged_and_rejected_ones_rolled_back():
    sched = mini.create_scheduler(block_size=4, num_speculative_tokens=3)
    req = _decoding_request(sched, [5, 6, 7])
    out = sched.schedule()
    # 1 real token + 3 drafts, all counted as computed until verified.
    assert out.num_scheduled_tokens == {req.request_id: 4}
    assert out.scheduled_spec_decode_tokens == {req.request_id: [5, 6, 7]}
    assert req.num_computed_tokens == 9 + 3 and req.spec_token_ids == []
    # The runner accepted draft 5, rejected 6 (and so 7), and sampled 42.
    runner = mini.ModelRunnerOutput([req.request_id], {req.request_id: 0}, [[5, 42]])
    stats = sched.update_from_output(out, runner).scheduler_stats.spec_decoding_stats
    assert req.num_computed_tokens == 12 - 2 and req.num_tokens == 11
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)
    assert stats.num_accepted_tokens_per_pos == [1, 0, 0]


def test_budget_cuts_the_drafts():
    sched = mini.create_scheduler(
        block_size=4,
        num_speculative_tokens=3,
        max_num_batched_tokens=2,
        max_num_seqs=1,
        max_model_len=64,
    )
    # Prefill 8 tokens through a 2-token budget first.
    (req,) = mini.create_requests(1, num_tokens=8, max_tokens=20, block_size=4)
    sched.add_request(req)
    for _ in range(4):
        out = sched.schedule()
        sched.update_from_output(out, mini.make_model_runner_output(sched, out, lambda r: 1001))
    sched.update_draft_token_ids(DraftTokenIds([req.request_id], [[5, 6, 7]]))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {req.request_id: 2}
    assert out.scheduled_spec_decode_tokens == {req.request_id: [5]}


def test_drafts_for_a_request_mid_prefill_are_dropped():
    sched = mini.create_scheduler(
        block_size=4,
        num_speculative_tokens=3,
        max_num_batched_tokens=4,
        max_num_seqs=1,
        max_model_len=64,
    )
    (req,) = mini.create_requests(1, num_tokens=8, max_tokens=20, block_size=4)
    sched.add_request(req)
    out = sched.schedule()
    sched.update_from_output(out, mini.make_model_runner_output(sched, out, lambda r: 1001))
    assert req.is_prefill_chunk
    sched.update_draft_token_ids(DraftTokenIds([req.request_id], [[5, 6]]))
    assert req.spec_token_ids == []


def test_async_scheduling_with_ngram_drafts_is_refused():
    """Upstream refuses the n-gram drafter with async scheduling
    (vllm/config/vllm.py:911-924); so does mini_vllm, before anything is built.
    (mini.create_scheduler builds the AsyncScheduler with drafts for the
    async lockstep: the scheduler upstream runs for a drafter in the worker.)"""
    with pytest.raises(ValueError, match="async_scheduling=True does not work"):
        VllmConfig(
            scheduler_config=SchedulerConfig(async_scheduling=True),
            speculative_config=SpeculativeConfig(num_speculative_tokens=2),
        )


@pytest.mark.parametrize(
    "config, match",
    [
        (
            {"num_speculative_tokens": 2, "num_lookahead_slots": 1},
            r"unsupported keys \['num_lookahead_slots'\]",
        ),
        (3, "must be a dict"),
    ],
)
def test_speculative_config_dict_is_checked_by_name(config, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(config)
    assert SpeculativeConfig.from_dict({"num_speculative_tokens": 2}).num_speculative_tokens == 2
