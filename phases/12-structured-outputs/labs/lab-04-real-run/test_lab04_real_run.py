"""Lab 12.4 — a real run: SmolLM2 held to a JSON schema by your Phase 12.

No new code: every Phase 12 region is yours (the ``phase`` marker). Your
Scheduler (``scheduler_cls``), your StructuredOutputManager (built by
``EngineCore``) and your ``apply_grammar_bitmask`` (called by the runner)
are plugged into mini_vllm's engine, which generates greedily for 50
prompts, every one held to the same JSON schema (phase12_run_helpers.py).

1. Every output parses as JSON and validates against the schema
   (``jsonschema``), and ends with EOS, not at ``max_tokens``.
2. The greedy tokens are transformers' greedy run constrained by the same
   grammar. Proved by teacher forcing: one transformers forward over every
   (prompt + engine output) sequence, and a fresh xgrammar matcher compiled
   from the same schema walked along the engine's tokens; at every output
   position the argmax of transformers' logits, masked by that matcher's
   bitmask, must be the engine's token. By induction on the position this
   is exactly what transformers' own greedy ``generate`` with the grammar
   would produce, token for token.
"""

from __future__ import annotations

import json

import pytest
import torch
import xgrammar as xgr
from phase12_run_helpers import MAX_TOKENS, PROMPTS, SCHEMA, VOCAB

pytestmark = [pytest.mark.phase, pytest.mark.timeout(600)]


@pytest.mark.points(10)
def test_every_output_parses_and_validates(smollm2_run):
    import jsonschema

    run, _ = smollm2_run
    for i, (text, reason) in enumerate(zip(run.texts, run.finish_reasons, strict=True)):
        where = f"prompt {i} ({PROMPTS[i]!r}), held to phase12_run_helpers.SCHEMA"
        if reason == "error":
            pytest.fail(
                f"{where}: after {text!r} the request ended with finish_reason error: its "
                "grammar refused a token the engine had sampled through your bitmask (the "
                "scheduler logs 'grammar rejected tokens'). Either the mask let through a "
                "token the grammar forbids (a row not applied, applied to another request's "
                "logits, or built for another request: Labs 12.2 and 12.3), or the grammar's "
                "state is not the request's (kept tokens not fed, or fed twice: Lab 12.3)."
            )
        assert reason == "stop", (
            f"{where}: the output {text!r} ended by {reason!r}, not at EOS, after "
            f"{len(run.tokens[i])} tokens (max_tokens {MAX_TOKENS}). The grammar allows EOS "
            "only once the JSON is complete, and SmolLM2 closes this schema's objects in "
            "about 25 tokens: a mask that lets other tokens through wanders off."
        )
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            pytest.fail(
                f"{where}: the output {text!r} is not JSON ({e}). Every token was sampled "
                "through your bitmask: a row not applied, applied to the wrong request's logits "
                "(Lab 12.3), built for the wrong request (Lab 12.2), or a grammar that did not "
                "take the kept tokens (Lab 12.3) lets a token through that the schema forbids."
            )
        try:
            jsonschema.validate(value, SCHEMA)
        except jsonschema.ValidationError as e:
            pytest.fail(f"{where}: the output {text!r} parses but breaks the schema: {e.message}")


@pytest.mark.points(15)
def test_greedy_tokens_equal_transformers_constrained_by_the_same_grammar(
    smollm2_run, transformers_check
):
    run, _ = smollm2_run
    logits, fresh_matcher, hf_seconds = transformers_check
    tok = run.tokenizer
    smallest = None  # (top-1 minus top-2 masked logit, prompt, position)
    overridden = 0  # positions where the mask removed transformers' unconstrained argmax
    for i, (tokens, rows) in enumerate(zip(run.tokens, logits, strict=True)):
        # The fresh matcher's bitmask before each output token, walking the engine's tokens.
        matcher = fresh_matcher()
        bitmask = xgr.allocate_token_bitmask(len(tokens), VOCAB)  # int32 [n, ceil(V / 32)]
        walked = 0
        for k, token in enumerate(tokens):
            matcher.fill_next_token_bitmask(bitmask, k)
            walked = k + 1
            if not matcher.accept_token(token):
                break  # a token the grammar refuses: position k fails below
        scores = rows[:walked].clone()  # float [walked, V]
        unconstrained = scores.argmax(dim=-1)
        xgr.apply_token_bitmask_inplace(scores, bitmask[:walked])  # V = 49152: 32 divides it
        overridden += int(torch.isinf(scores.gather(1, unconstrained[:, None])).sum())
        top = torch.topk(scores, 2, dim=-1)
        for k in range(walked):
            token, want = tokens[k], int(top.indices[k, 0])
            margin = float(top.values[k, 0] - top.values[k, 1])
            if want != token:
                allowed = bool(torch.isfinite(scores[k, token]))
                pytest.fail(
                    f"prompt {i} ({PROMPTS[i]!r}), output position {k}: the engine chose "
                    f"{token} {tok.decode([token])!r}, transformers' masked argmax is {want} "
                    f"{tok.decode([want])!r} (after {tok.decode(tokens[:k])!r}); the engine's "
                    f"token is {'allowed' if allowed else 'DISALLOWED'} by the grammar; "
                    f"transformers' top-1 minus top-2 masked logit is {margin:.4g}"
                    + (f", the engine's token {float(scores[k, token]):.4g}." if allowed else ".")
                    + " A disallowed token means a mask not applied or applied to another "
                    "request's logits row; an allowed but lower one, a row built for another "
                    "request or another state of its grammar (Labs 12.2 and 12.3)."
                )
            if smallest is None or margin < smallest[0]:
                smallest = (margin, i, k)
        assert matcher.is_terminated(), (
            f"prompt {i} ({PROMPTS[i]!r}): the engine stopped after {tok.decode(tokens)!r}, "
            "before the grammar was done"
        )
    # The grammar mattered: somewhere SmolLM2 wanted a token the schema forbids.
    assert overridden > 0, "the mask never overrode transformers' unconstrained argmax"
    print(
        f"\nLab 12.4: {sum(map(len, run.tokens))} tokens, mask overrode the unconstrained "
        f"argmax at {overridden} positions; smallest top-1 vs top-2 masked logit margin "
        f"{smallest[0]:.4g} (prompt {smallest[1]}, position {smallest[2]}); seconds: engine "
        f"load {run.stats['load_seconds']:.1f}, its run {run.seconds:.1f}, transformers load "
        f"and forward {hf_seconds:.1f}"
    )
