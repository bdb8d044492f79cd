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
is all ones.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import xgrammar as xgr

import mini_vllm.testing as mini

pytestmark = pytest.mark.upstream

VOCAB = 49152
NUM_SPEC = 2
STEPS = 14
CONSTRAINTS = {
    "json": {
        "json": {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "tag": {"type": "string", "maxLength": 4}},
            "required": ["id", "tag"],
        }
    },
    "json_object": {"json_object": True},
    "regex": {"regex": r"[a-c]{2,5}(-[0-9]{1,3})?"},
    "choice": {"choice": ["alpha", "beta", "gamma delta"]},
    "grammar": {"grammar": 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'},
}


@pytest.fixture(scope="module")
def upstream():
    from mini_vllm.oracle import upstream as up

    return up


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from mini_vllm.model_executor.model_loader import smollm2_gguf_path

    path = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def compiled(backend, manager, req_id: str, constraint: dict):
    (request,) = backend.create_requests(
        1, req_ids=[req_id], prompt_token_ids=[[1, 2, 3]], structured_outputs=constraint
    )
    manager.grammar_init(request)
    request.structured_output_request.grammar = request.structured_output_request._grammar.result()
    return request


def walk(tokenizer, mini_request, rng: random.Random, length: int) -> list[int]:
    """A valid token history for the request's grammar: each token drawn from
    what a fresh matcher allows (EOS ends it early)."""
    ctx = mini_request.structured_output_request.grammar.ctx
    matcher = xgr.GrammarMatcher(ctx)
    row = xgr.allocate_token_bitmask(1, VOCAB)
    history = []
    while len(history) < length and not matcher.is_terminated():
        matcher.fill_next_token_bitmask(row, 0)
        bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")[:VOCAB]
        allowed = np.flatnonzero(bits).tolist()
        token = rng.choice(allowed)
        assert matcher.accept_token(token)
        history.append(token)
    return history


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
        histories[name] = walk(tokenizer, mine[name], rng, STEPS + NUM_SPEC)

    for step in range(STEPS):
        # A request whose history ended in EOS stays, its grammar terminated.
        live = [
            n
            for n in CONSTRAINTS
            if step < len(histories[n]) or mine[n].structured_output_request.grammar.is_terminated()
        ]
        order = rng.sample(live, len(live))
        # Drafts for some requests: the next tokens of their history.
        drafts = {
            n: histories[n][step : step + NUM_SPEC]
            for n in order
            if rng.random() < 0.5 and histories[n][step : step + NUM_SPEC]
        }
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
        for n in order:
            if step >= len(histories[n]):
                continue
            token = histories[n][step]
            assert mine[n].structured_output_request.grammar.accept_tokens(n, [token])
            assert theirs[n].structured_output_request.grammar.accept_tokens(n, [token])
