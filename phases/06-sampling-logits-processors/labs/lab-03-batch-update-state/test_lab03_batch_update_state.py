"""Lab 06.3 — per-row state that follows the persistent batch (``BatchUpdate``).

Graded: the ``LAB 06.3`` regions of ``labs/phase_06/builtin.py``:
``process_dict_updates`` (the sparse row -> state dict that logit_bias and
min_tokens keep) and the removals and moves of
``MinPLogitsProcessor.update_state`` (min_p's dense array and its count).

First the rules on hand-made updates; then generated operation sequences
shaped like the persistent batch's (requests leave and leave holes, new ones
fill the lowest holes, condense moves the highest rows down, rows swap,
outputs grow) drive your processors and the pinned upstream's built-ins
(vllm/v1/sample/logits_processor/builtin.py:22, :118, :167) with the same
``BatchUpdate`` at every step: their state and what ``apply`` does to the
same logits must be equal after every step.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from phase06_helpers import processor, written

from mini_vllm.grading.checks import lab_settings
from mini_vllm.oracle.sampler_workload import CONFIG, batch_update_of, update_steps
from mini_vllm.sample.logits_processor import BatchUpdate, MoveDirectionality, builtin
from mini_vllm.sampling_params import SamplingParams

LOCKSTEP = lab_settings(60)
SWAP, MOVE = MoveDirectionality.SWAP, MoveDirectionality.UNIDIRECTIONAL
VOCAB = 12


def update(size, removed=(), added=(), moved=()):
    return BatchUpdate(batch_size=size, removed=list(removed), added=list(added), moved=list(moved))


def run(impl, entries: dict, batch_update) -> tuple[bool, dict]:
    """Your process_dict_updates on ``entries`` (a copy), the state being the bias."""
    entries = dict(entries)
    changed = written(
        impl.builtin.process_dict_updates,
        entries,
        batch_update,
        lambda params, _, __: params.logit_bias or None,
    )
    return changed, entries


def bias(b):
    return SamplingParams(logit_bias=b)


# ------------------------------------------------------------------ the rules


@pytest.mark.points(3)
def test_added_rows_get_a_state_or_lose_the_old_one(impl):
    changed, got = run(impl, {}, None)
    assert (changed, got) == (False, {}), "No BatchUpdate (None): nothing changes, return False."
    old = {0: {1: 1.0}, 2: {3: 2.0}}
    added = [(0, bias({5: 5.0}), [0], []), (2, bias(None), [0], []), (4, bias(None), [0], [])]
    changed, got = run(impl, old, update(5, added=added))
    assert got == {0: {5: 5.0}}, (
        f"Rows 0 and 2 held {old}; new requests took row 0 (bias {{5: 5.0}}), row 2 (no bias) "
        f"and row 4 (no bias). Got {got}, want {{0: {{5: 5.0}}}}: an added row gets its new "
        "state, and a row whose new request needs none must lose what the old request left."
    )
    assert changed is True, "The dict changed: process_dict_updates must return True."
    changed, got = run(impl, {}, update(1, added=[(0, bias(None), [0], [])]))
    assert (changed, got) == (False, {}), (
        f"A request without a bias added to an empty dict changes nothing: got {(changed, got)}, "
        "want (False, {}). The processors rebuild their tensors only on True."
    )


@pytest.mark.points(3)
def test_removed_rows_lose_their_state(impl):
    changed, got = run(impl, {1: {2: 1.0}, 3: {4: 4.0}}, update(2, removed=[3, 0]))
    assert (changed, got) == (True, {1: {2: 1.0}}), (
        f"Removing rows 3 and 0 from {{1: ..., 3: ...}}: got {(changed, got)}, want "
        "(True, {1: {2: 1.0}}): a removed row's entry goes; a removed row without one changes "
        "nothing."
    )
    changed, got = run(impl, {1: {2: 1.0}}, update(2, removed=[0]))
    assert (changed, got) == (False, {1: {2: 1.0}}), (
        f"Removing row 0, which held no entry: got {(changed, got)}; nothing changed: False."
    )


@pytest.mark.points(4)
def test_moves_carry_states_swaps_exchange_them(impl):
    a, b = {1: 1.0}, {2: 2.0}
    changed, got = run(impl, {5: a, 1: b}, update(4, moved=[(5, 1, MOVE)]))
    assert (changed, got) == (True, {1: a}), (
        f"UNIDIRECTIONAL move 5 -> 1 (condense) with row 5 = {a} and row 1 = {b}: got "
        f"{(changed, got)}, want (True, {{1: {a}}}): a's state goes to b, a is left empty and "
        "what b held is gone (its request left the batch)."
    )
    changed, got = run(impl, {5: a, 1: b}, update(6, moved=[(5, 1, SWAP)]))
    assert got == {1: a, 5: b} and changed, f"SWAP 5 <-> 1: got {(changed, got)}; want both moved"
    changed, got = run(impl, {1: b}, update(6, moved=[(5, 1, SWAP)]))
    assert got == {5: b} and changed, (
        f"SWAP 5 <-> 1 where only row 1 has a state: got {(changed, got)}, want {{5: {b}}}."
    )
    changed, got = run(impl, {1: b}, update(6, moved=[(5, 1, MOVE)]))
    assert (changed, got) == (True, {}), (
        f"UNIDIRECTIONAL 5 -> 1 where only row 1 has a state: got {(changed, got)}, want "
        "(True, {}): b's old state is dropped even though a brought none."
    )
    changed, got = run(impl, {0: a}, update(6, moved=[(5, 1, SWAP), (1, 3, MOVE)]))
    assert (changed, got) == (False, {0: a}), (
        f"Moves between rows without state: got {(changed, got)}, want (False, {{0: {a}}})."
    )
    changed, got = run(impl, {2: a}, update(6, moved=[(2, 3, SWAP), (3, 0, MOVE)]))
    assert got == {0: a}, f"Moves apply in list order: 2 <-> 3 then 3 -> 0; got {got}"


@pytest.mark.points(4)
def test_min_p_array_and_count_follow_the_rows(impl):
    proc = processor(impl.builtin.MinPLogitsProcessor)
    added = [(i, SamplingParams(min_p=m), [0], []) for i, m in enumerate([0.1, 0.0, 0.3, 0.5])]
    written(proc.update_state, update(4, added=added))
    assert proc.min_p_count == 3
    written(proc.update_state, update(3, removed=[3], moved=[(2, 1, SWAP)]))
    got = (proc.min_p_cpu[:4].tolist(), proc.min_p_count)
    want = ([0.1, 0.3, 0.0, 0.0], 2)
    assert torch.allclose(torch.tensor(got[0]), torch.tensor(want[0])) and got[1] == want[1], (
        f"min_p rows [0.1, 0, 0.3, 0.5]; remove row 3, swap rows 2 and 1: got slots and count "
        f"{got}, want {want}. A removed row's slot becomes 0 (and leaves the count); a SWAP "
        "exchanges two slots."
    )
    written(proc.update_state, update(1, moved=[(1, 0, MOVE)]))
    got = (proc.min_p_cpu[:2].tolist(), proc.min_p_count)
    assert torch.allclose(torch.tensor(got[0]), torch.tensor([0.3, 0.0])) and got[1] == 1, (
        f"UNIDIRECTIONAL 1 -> 0 with slots [0.1, 0.3]: got {got}, want ([0.3, 0.0], 1): row 0 "
        "takes 0.3, row 1 is left 0, and row 0's old 0.1 is gone, so the count drops to 1."
    )
    assert torch.equal(proc.min_p, torch.tensor([[0.3]])), (
        f"After the update, min_p (the rows in use, [batch_size, 1]) should be [[0.3]]; got "
        f"{proc.min_p.tolist()}"
    )


# ------------------------------------------------------------------ against upstream


def _state(procs) -> dict:
    """What each processor keeps, in a form both sides share."""
    bias, tokens, min_p = procs
    size = min_p.min_p.shape[0] if min_p.min_p_count else 0
    return {
        "logit_bias biases": dict(sorted(bias.biases.items())),
        "min_tokens (min, output, stop ids)": {
            row: (n, list(out), sorted(stop))
            for row, (n, out, stop) in sorted(tokens.min_toks.items())
        },
        "min_p count": min_p.min_p_count,
        "min_p rows in use": min_p.min_p.view(-1).tolist() if size else None,
    }


@pytest.mark.upstream
@pytest.mark.points(12)
@pytest.mark.timeout(180)
@LOCKSTEP
@given(steps=update_steps(vocab=VOCAB))
def test_processors_follow_the_batch_as_upstreams_do(impl, up, steps, monkeypatch):
    # The reference's update_state calls process_dict_updates by its module name: yours.
    monkeypatch.setattr(builtin, "process_dict_updates", impl.builtin.process_dict_updates)
    cpu = torch.device("cpu")
    mine = (
        processor(impl.builtin.LogitBiasLogitsProcessor),
        processor(builtin.MinTokensLogitsProcessor),
        processor(impl.builtin.MinPLogitsProcessor),
    )
    theirs = None
    mine_out, their_out = {}, {}
    gen = torch.Generator().manual_seed(0)
    for i, step in enumerate(steps):
        mine_update = batch_update_of(
            step, SamplingParams, BatchUpdate, MoveDirectionality, mine_out
        )
        for proc in mine:
            written(proc.update_state, mine_update)
        if theirs is None:  # after your first update: an unwritten region fails without it
            theirs = tuple(
                getattr(up.lp, name)(CONFIG, cpu, False)
                for name in (
                    "LogitBiasLogitsProcessor",
                    "MinTokensLogitsProcessor",
                    "MinPLogitsProcessor",
                )
            )
        their_update = batch_update_of(
            step, up.SamplingParams, up.lp.BatchUpdate, up.lp.MoveDirectionality, their_out
        )
        for proc in theirs:
            written(proc.update_state, their_update)
        where = (
            f"step {i} (removed {step.removed}, added rows {[a[0] for a in step.added]} with "
            f"{[a[1] for a in step.added]}, moved {step.moved}, batch size {step.batch_size})\n"
            f"all steps: {steps}"
        )
        got, want = _state(mine), _state(theirs)
        for key in want:
            assert got[key] == want[key], (
                f"{key}: yours {got[key]}, upstream {want[key]} after {where}"
            )
        logits = torch.randn(step.batch_size, VOCAB, generator=gen)
        for proc, ref, name in zip(
            mine, theirs, ("logit_bias", "min_tokens", "min_p"), strict=True
        ):
            got_logits = written(proc.apply, logits.clone())
            want_logits = ref.apply(logits.clone())
            assert torch.equal(got_logits, want_logits), (
                f"{name}.apply after {where}\nyours\n{got_logits}\nupstream\n{want_logits}\n"
                "(state equal but logits not: process_dict_updates returned False when the dict "
                "changed, so the processor kept stale tensors?)"
            )
        for number, token in step.sampled:
            mine_out[number].append(token)
            their_out[number].append(token)
