"""Lab 15.4 — a stored prefix, skipped: SmolLM2 through your Phase 15.

No new code: every Phase 15 region is yours (the ``phase`` marker). Your
Scheduler (``scheduler_cls``) and your ExampleConnector (loaded by the
engine's scheduler and its model runner through ``kv_connector_module_path``,
as upstream's factory loads an out-of-tree connector,
vllm/distributed/kv_transfer/kv_connector/factory.py:96) run in mini_vllm's
engine on SmolLM2-135M, greedily, on three prompts (conftest.py). Two
engines share the weights and one storage folder:

1. the first saves each prompt's KV (its whole blocks but the last token's)
   as its forward pass writes it, and samples the tokens of an engine
   without any connector;
2. the second, fresh (nothing in its own prefix cache), finds the stored
   prefixes, schedules only the tokens past them, and samples the same
   tokens;
3. which are transformers' greedy tokens on the same weights.
"""

from __future__ import annotations

import os

import pytest
from phase15_run_helpers import BLOCK_SIZE, PROMPTS

pytestmark = [pytest.mark.phase, pytest.mark.timeout(600)]


def stored_tokens(prompt_ids: list[list[int]]) -> int:
    """The tokens the connector stores for these prompts (upstream's
    align_to_block_size of all tokens but the last: whole blocks)."""
    return sum((len(ids) - 2) // BLOCK_SIZE * BLOCK_SIZE for ids in prompt_ids)


def first_difference(a: list[int], b: list[int]) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))


@pytest.mark.points(6)
def test_the_first_engine_saves_and_samples_the_plain_tokens(stored_runs, smollm2):
    _, (plain, plain_stats), prompt_ids = smollm2
    tokens, stats = stored_runs["first"]
    for i, (got, want) in enumerate(zip(tokens, plain, strict=True)):
        assert got == want, (
            f"prompt {i} ({PROMPTS[i][:40]!r}...): the saving engine sampled {got}, an engine "
            f"without a connector {want} (first difference at output {first_difference(got, want)}"
            "). Saving reads the cache; it must not change what the forward pass computes."
        )
    assert stats["num_scheduled_tokens"] == plain_stats["num_scheduled_tokens"], (
        "the first engine has nothing stored yet: it computes every token, as the plain engine "
        f"does ({stats['num_scheduled_tokens']} scheduled, want "
        f"{plain_stats['num_scheduled_tokens']})"
    )
    folders = os.listdir(stored_runs["storage"])
    assert len(folders) == len(PROMPTS), (
        f"one stored folder per prompt (keyed by its stored tokens): {folders}"
    )
    for folder in folders:
        files = os.listdir(stored_runs["storage"] / folder)
        assert len(files) == 30, f"{folder}: one file per attention layer (30), got {len(files)}"


@pytest.mark.points(8)
def test_a_fresh_engine_skips_the_stored_prefill(stored_runs, smollm2):
    _, (plain, plain_stats), prompt_ids = smollm2
    tokens, stats = stored_runs["second"]
    skipped = plain_stats["num_scheduled_tokens"] - stats["num_scheduled_tokens"]
    assert skipped == stored_tokens(prompt_ids), (
        f"the second engine must find each prompt's stored whole blocks and schedule only the "
        f"rest: it skipped {skipped} tokens, the store holds {stored_tokens(prompt_ids)} "
        f"(prompts of {[len(p) for p in prompt_ids]} tokens, blocks of {BLOCK_SIZE})."
    )
    for i, (got, want) in enumerate(zip(tokens, plain, strict=True)):
        assert got == want, (
            f"prompt {i} ({PROMPTS[i][:40]!r}...): after loading its stored KV the fresh engine "
            f"sampled {got}, an engine without a connector {want} (first difference at output "
            f"{first_difference(got, want)}). The loaded KV is not what the first engine "
            "computed, or not in the slots the forward pass reads."
        )


@pytest.mark.points(6)
def test_the_tokens_are_transformers_greedy_tokens(stored_runs, transformers_tokens):
    tokens, _ = stored_runs["second"]
    for i, (got, want) in enumerate(zip(tokens, transformers_tokens, strict=True)):
        assert got == want, (
            f"prompt {i} ({PROMPTS[i][:40]!r}...): the engine that loaded the stored prefix "
            f"sampled {got}; transformers' greedy loop on the same weights {want}."
        )
