"""Structured outputs against the pinned upstream: the grammar bitmask, bit for bit.

mini_vllm's ``StructuredOutputManager.grammar_bitmask`` and upstream's
(vllm/v1/structured_output/__init__.py:204) get the same requests (a JSON
schema, ``json_object``, a regex, a choice, an EBNF grammar), compiled on
both sides from SmolLM2's tokenizer (upstream loads it back from a folder
transformers saved it to), the same token histories, a scheduled order that
changes every step, and drafts (n-gram speculation, 2 a request) on some
steps. Every step's bitmask must be equal, every int32 word of it; then both
sides' grammars take the step's token.

The histories are walks through the grammar: each token is drawn, with a
fixed seed, from the tokens a fresh xgrammar matcher allows next, so every
history is valid and some of them end the grammar (EOS), after which a row
is all ones. The workload is mini_vllm/oracle/structured_workload.py's,
shared with Lab 12.2's grader.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

import mini_vllm.testing as mini
from mini_vllm.oracle.structured_workload import (
    CONSTRAINTS,
    NUM_SPEC,
    STEPS,
    bitmask_steps,
    compiled,
    smollm2_tokenizer,
    walk,
)

pytestmark = pytest.mark.upstream


@pytest.fixture(scope="module")
def upstream():
    from mini_vllm.oracle import upstream as up

    return up


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_tokenizer()


@pytest.mark.parametrize("seed", [0, 1])
def test_grammar_bitmask_equals_upstreams_bit_for_bit(upstream, tokenizer, counts, seed):
    rng = random.Random(seed)
    mini_manager = mini.create_structured_output_manager(
        tokenizer, max_num_seqs=8, num_speculative_tokens=NUM_SPEC
    )
    up_manager = upstream.create_structured_output_manager(
        tokenizer, max_num_seqs=8, num_speculative_tokens=NUM_SPEC
    )
    mine, theirs, histories = {}, {}, {}
    for name, constraint in CONSTRAINTS.items():
        mine[name] = compiled(mini, mini_manager, name, constraint)
        theirs[name] = compiled(upstream, up_manager, name, constraint)
        ctx = mine[name].structured_output_request.grammar.ctx
        histories[name] = walk(ctx, len(tokenizer), rng, STEPS + NUM_SPEC)

    for step, order, drafts in bitmask_steps(mine, theirs, histories, rng):
        got = mini_manager.grammar_bitmask(mine, order, drafts)
        want = up_manager.grammar_bitmask(theirs, order, drafts)
        assert got.dtype == want.dtype and got.shape == want.shape, (step, got.shape, want.shape)
        if not np.array_equal(got, want):
            row = int(np.flatnonzero((got != want).any(axis=1))[0])
            pytest.fail(
                f"step {step}: bitmask row {row} differs (order {order}, drafts {drafts}); "
                f"{int((got[row] != want[row]).sum())} of {got.shape[1]} words"
            )
        counts["structured bitmask rows compared"] = (
            counts.get("structured bitmask rows compared", 0) + got.shape[0]
        )
        counts["structured bitmask all-ones rows"] = counts.get(
            "structured bitmask all-ones rows", 0
        ) + int((got == -1).all(axis=1).sum())
