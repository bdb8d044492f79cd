"""Structured-output workloads for the bitmask locksteps against upstream.

Shared by tests/upstream/test_structured_output_lockstep.py and Lab 12.2's
grader (phases/12-structured-outputs/labs/lab-02-bitmask/): both compile the
same constraints on two sides (mini_vllm's or a student's
``StructuredOutputManager``, and upstream's), walk valid token histories
through the grammars, and compare every step's ``grammar_bitmask`` word for
word.

- ``CONSTRAINTS``: one of each kind (a JSON schema, ``json_object``, a regex,
  a choice, an EBNF grammar);
- ``smollm2_tokenizer()``: SmolLM2's Hugging Face tokenizer (the vocabulary
  both sides compile against);
- ``compiled(backend, manager, req_id, constraint)``: a request of
  ``backend`` (mini_vllm.testing or mini_vllm.oracle.upstream) whose grammar
  ``manager`` compiled, the future already resolved;
- ``walk(ctx, vocab_size, rng, length)``: a valid token history, each token
  drawn from what a fresh xgrammar matcher allows next;
- ``fresh_row(ctx, vocab_size, prefix)``: the row a fresh matcher fills after
  ``prefix`` (the oracle for one row);
- ``bitmask_steps(...)``: the lockstep's schedule of steps (scheduled order,
  drafts), advancing both sides' grammars between steps.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np

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


def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer, read from its GGUF file (offline)."""
    from transformers import AutoTokenizer

    from mini_vllm.model_executor.model_loader import smollm2_gguf_path

    path = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def compiled(backend, manager, req_id: str, constraint: dict, prompt=(1, 2, 3), **kwargs):
    """A ``backend`` request carrying ``constraint``, its grammar compiled by
    ``manager`` (``grammar_init``, then the future's result put in its place)."""
    (request,) = backend.create_requests(
        1,
        req_ids=[req_id],
        prompt_token_ids=[list(prompt)],
        structured_outputs=constraint,
        **kwargs,
    )
    manager.grammar_init(request)
    request.structured_output_request.grammar = request.structured_output_request._grammar.result()
    return request


def allowed_tokens(row, vocab_size: int) -> list[int]:
    """The token ids a bitmask row (int32 words, bit j of word i = token 32 i + j) allows."""
    words = np.asarray(row, dtype=np.int32)
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits).tolist()


def fresh_row(ctx, vocab_size: int, prefix=()) -> np.ndarray:
    """int32 [ceil(vocab / 32)]: the row a brand-new xgrammar matcher on
    ``ctx`` fills after accepting ``prefix`` (all ones once it terminated,
    as the managers fill a terminated grammar's row)."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(ctx)
    for token in prefix:
        assert matcher.accept_token(token), (token, prefix)
    row = xgr.allocate_token_bitmask(1, vocab_size)
    if not matcher.is_terminated():
        matcher.fill_next_token_bitmask(row, 0)
    return row[0].numpy()


def walk(ctx, vocab_size: int, rng: random.Random, length: int, avoid=()) -> list[int]:
    """A valid token history for the grammar ``ctx``: each token drawn from
    what a fresh matcher allows next (tokens in ``avoid`` only when nothing
    else is allowed); it ends early once the grammar terminates."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(ctx)
    row = xgr.allocate_token_bitmask(1, vocab_size)
    history: list[int] = []
    while len(history) < length and not matcher.is_terminated():
        matcher.fill_next_token_bitmask(row, 0)
        allowed = allowed_tokens(row[0].numpy(), vocab_size)
        preferred = [t for t in allowed if t not in avoid] or allowed
        token = rng.choice(preferred)
        assert matcher.accept_token(token)
        history.append(token)
    return history


def bitmask_steps(
    mine: dict, theirs: dict, histories: dict, rng: random.Random, steps: int = STEPS
) -> Iterator[tuple[int, list[str], dict[str, list[int]]]]:
    """Yield ``(step, order, drafts)`` for each step of a bitmask lockstep:
    the requests still live in a random scheduled order, and for about half
    of them the next ``NUM_SPEC`` tokens of their history as drafts. After
    each yield (the caller compares the two sides' ``grammar_bitmask`` for
    that order and those drafts) both sides' grammars take the step's token.

    ``mine`` and ``theirs``: {name: request} compiled by ``compiled``;
    ``histories``: {name: a ``walk`` of at least ``steps`` tokens, or one
    that ends the grammar}. A request whose history ended the grammar
    stays, terminated (its rows are all ones)."""
    for step in range(steps):
        live = [
            n
            for n in mine
            if step < len(histories[n]) or mine[n].structured_output_request.grammar.is_terminated()
        ]
        order = rng.sample(live, len(live))
        drafts = {
            n: histories[n][step : step + NUM_SPEC]
            for n in order
            if rng.random() < 0.5 and histories[n][step : step + NUM_SPEC]
        }
        yield step, order, drafts
        for n in order:
            if step >= len(histories[n]):
                continue
            token = histories[n][step]
            for side, requests in (("first", mine), ("second", theirs)):
                assert requests[n].structured_output_request.grammar.accept_tokens(n, [token]), (
                    f"step {step}: the {side} side's grammar for {n!r} refused token {token} of "
                    "its valid history: its state had moved (grammar_bitmask must leave every "
                    "grammar as it found it)"
                )
