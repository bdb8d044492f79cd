"""Lab 06.1 — penalties and logit bias: what each one reads, in upstream's order.

Graded: the ``LAB 06.1`` regions of ``labs/phase_06/penalties.py``
(``apply_penalties``: which tokens each penalty reads, in order;
``apply_repetition_penalties``) and of ``labs/phase_06/builtin.py``
(``LogitBiasLogitsProcessor.apply``).

First the rules one by one on a single row, each expected value computed
here from the definition; then generated batches against the pinned
upstream: your ``apply_penalties`` against upstream's ``apply_all_penalties``
(vllm/v1/sample/ops/penalties.py:11), and the whole of
``Sampler.apply_logits_processors`` (allowed ids, bad words, min_tokens,
your logit bias, your penalties) against upstream's, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from phase06_helpers import plug_into_engine, processor, written

from mini_vllm.grading.checks import lab_settings
from mini_vllm.oracle.sampler_workload import (
    describe,
    first_row_difference,
    mini_batch,
    sampler_cases,
    upstream_batch,
)
from mini_vllm.sample.logits_processor import BatchUpdate
from mini_vllm.sample.ops.penalties import _convert_to_tensors
from mini_vllm.sample.sampler import Sampler
from mini_vllm.sampling_params import SamplingParams

LOCKSTEP = lab_settings(60)
V = 8


def penalise(impl, logits, prompts, outputs, presence=0.0, frequency=0.0, repetition=1.0):
    """Your ``apply_penalties`` on float32 [B, V] ``logits`` (a copy), with the
    token lists padded as ``apply_all_penalties`` pads them; one penalty value
    for every row."""
    logits = logits.clone()
    rows, vocab = logits.shape
    prompt = _convert_to_tensors(prompts, vocab, logits.device)  # int64 [B, max prompt]
    output = _convert_to_tensors(outputs, vocab, logits.device)  # int64 [B, max output]
    full = torch.full((rows,), 1.0)
    return written(
        impl.penalties.apply_penalties,
        logits,
        prompt,
        output,
        full * presence,
        full * frequency,
        full * repetition,
    )


ROW = torch.tensor([[2.0, -1.5, 0.75, -0.25, 3.0, 1.0, -2.0, 0.5]])  # float32 [1, 8]


# ------------------------------------------------------------------ the rules


@pytest.mark.points(3)
def test_repetition_reads_prompt_and_output_and_shrinks_either_sign(impl):
    prompt, output = [[0, 1]], [[2, 3, 3]]  # tokens 0..3 seen; 4..7 never
    p = 1.3
    got = penalise(impl, ROW, prompt, output, repetition=p)
    factor = torch.tensor(1.0) / torch.tensor(p)  # the reciprocal, in float32, as upstream
    for t in range(V):
        x = ROW[0, t]
        want = (x * factor if x > 0 else x * torch.tensor(p)) if t <= 3 else x
        where = "the prompt" if t < 2 else ("the output" if t < 4 else "neither")
        assert torch.equal(got[0, t], want), (
            f"Repetition penalty {p}, token {t} (logit {float(x)}, seen in {where}): got "
            f"{float(got[0, t])}, want {float(want)}. The rule: a token seen in the prompt OR "
            "the output has its positive logit multiplied by 1/p and its negative logit "
            "multiplied by p (so it always gets less likely); unseen tokens are untouched."
        )
    # The reciprocal, not a division: find a logit where the two round differently.
    xs = torch.linspace(0.1, 9.0, 4001)  # float32
    differs = xs[(xs * factor) != (xs / torch.tensor(p))]
    assert differs.numel(), "no float32 logit tells x * (1/p) from x / p (the test's search)"
    x = differs[:1].view(1, 1)
    row = torch.cat([x, torch.zeros(1, V - 1)], dim=1)
    got = penalise(impl, row, [[0]], [[]], repetition=p)[0, 0]
    assert torch.equal(got, x[0, 0] * factor), (
        f"Logit {float(x)} with repetition penalty {p}: got {float(got)}, want "
        f"{float(x[0, 0] * factor)} = x * (1 / p). Upstream multiplies by the reciprocal; "
        f"x / p = {float(x[0, 0] / p)} rounds differently in float32, and the grade is bit for bit."
    )


@pytest.mark.points(3)
def test_frequency_counts_the_output_only(impl):
    prompt, output = [[0, 0, 1]], [[1, 2, 2, 2]]
    f = 0.5
    got = penalise(impl, ROW, prompt, output, frequency=f)
    counts = {1: 1, 2: 3}
    for t in range(V):
        want = ROW[0, t] - f * counts.get(t, 0)
        assert torch.allclose(got[0, t], want), (
            f"Frequency penalty {f}, token {t}: prompt {prompt[0]}, output {output[0]}: got "
            f"{float(got[0, t])}, want {float(want)}. The rule (OpenAI's): subtract penalty * "
            "(how many times the token is in the OUTPUT); the prompt does not count."
        )


@pytest.mark.points(3)
def test_presence_subtracts_once_per_token_in_the_output(impl):
    prompt, output = [[5, 6]], [[1, 2, 2, 2]]
    pres = 0.75
    got = penalise(impl, ROW, prompt, output, presence=pres)
    for t in range(V):
        want = ROW[0, t] - (pres if t in (1, 2) else 0.0)
        assert torch.allclose(got[0, t], want), (
            f"Presence penalty {pres}, token {t}: prompt {prompt[0]}, output {output[0]}: got "
            f"{float(got[0, t])}, want {float(want)}. The rule: subtract the penalty ONCE for "
            "each token present in the OUTPUT, however often; prompt tokens are not penalised."
        )


@pytest.mark.points(2)
def test_repetition_first_then_frequency_then_presence(impl):
    got = penalise(impl, ROW, [[]], [[0]], presence=0.5, frequency=1.0, repetition=2.0)
    want = ROW[0, 0] * (torch.tensor(1.0) / 2.0) - 1.0 - 0.5  # 2 * 0.5 - 1 - 0.5 = -0.5
    assert torch.allclose(got[0, 0], want), (
        f"Token 0 (logit 2.0, once in the output) with repetition 2, frequency 1, presence 0.5: "
        f"got {float(got[0, 0])}, want {float(want)}: the repetition penalty scales the logit "
        "FIRST (2.0 -> 1.0), then frequency and presence subtract (1.0 - 1 - 0.5). Subtracting "
        "first would leave 0.5 and then scale it to 0.25."
    )


@pytest.mark.points(2)
def test_padding_counts_for_nothing(impl):
    """Rows of different lengths are padded with vocab_size: no token has that id."""
    logits = ROW.repeat(2, 1)
    got = penalise(impl, logits, [[1], [1, 1, 1]], [[2, 2], []], presence=0.5, frequency=1.0)
    want = logits.clone()
    want[0, 2] -= 2 * 1.0 + 0.5
    assert torch.allclose(got, want), (
        f"Two rows, prompts [[1], [1, 1, 1]], outputs [[2, 2], []], frequency 1, presence 0.5: "
        f"got\n{got}\nwant\n{want}\nThe lists are padded to a rectangle with vocab_size ({V}); "
        "that id is no token: its counts must be dropped (an extra bin, then cut off), and a row "
        "with an empty output gets no frequency or presence penalty."
    )


@pytest.mark.points(3)
def test_logit_bias_adds_each_rows_biases(impl):
    proc = processor(impl.builtin.LogitBiasLogitsProcessor)
    added = [
        (0, SamplingParams(logit_bias={1: 2.5, 4: -100.0}), [0], []),
        (1, SamplingParams(), [0], []),
        (2, SamplingParams(logit_bias={0: 1.0}), [0], []),
    ]
    proc.update_state(BatchUpdate(batch_size=3, removed=[], added=added, moved=[]))
    logits = ROW.repeat(3, 1)
    logits[2, 0] = float("-inf")  # an earlier step (allowed ids, bad words) removed it
    want = logits.clone()
    want[0, 1] += 2.5
    want[0, 4] += -100.0
    got = written(proc.apply, logits.clone())
    assert torch.equal(got, want), (
        "logit_bias {1: 2.5, 4: -100} on row 0, none on row 1, {0: 1.0} on row 2 whose token 0 "
        f"is already -inf: got\n{got}\nwant\n{want}\nEach bias is ADDED to its own row's logit "
        "(not set, not added to every row), and -inf + bias stays -inf. apply returns the logits."
    )
    empty = processor(impl.builtin.LogitBiasLogitsProcessor)
    untouched = ROW.clone()
    assert torch.equal(written(empty.apply, untouched.clone()), untouched), (
        "With no biased row, apply must leave the logits as they are."
    )


# ------------------------------------------------------------------ against upstream


@st.composite
def penalty_batches(draw):
    vocab = draw(st.integers(2, 24))
    rows = draw(st.integers(1, 6))
    ids = st.integers(0, vocab - 1)
    prompts = [draw(st.lists(ids, min_size=1, max_size=8)) for _ in range(rows)]
    # -1: upstream's placeholder for a token not sampled yet (async scheduling).
    outputs = [draw(st.lists(ids | st.just(-1), max_size=8)) for _ in range(rows)]
    penalty = st.sampled_from
    pres = draw(st.lists(penalty([0.0, -2.0, -0.5, 0.3, 2.0]), min_size=rows, max_size=rows))
    freq = draw(st.lists(penalty([0.0, -1.0, 0.25, 1.5]), min_size=rows, max_size=rows))
    rep = draw(st.lists(penalty([1.0, 0.5, 1.1, 1.3, 2.0]), min_size=rows, max_size=rows))
    values = st.sampled_from([0.0, -0.0, 1.0, -1.0]) | st.floats(-20, 20, width=32)
    logits = draw(st.lists(values, min_size=rows * vocab, max_size=rows * vocab))
    return prompts, outputs, pres, freq, rep, torch.tensor(logits).view(rows, vocab)


@pytest.mark.upstream
@pytest.mark.points(6)
@pytest.mark.timeout(120)
@LOCKSTEP
@given(batch=penalty_batches())
def test_penalties_equal_upstreams_on_generated_batches(impl, up, batch):
    prompts, outputs, pres, freq, rep, logits = batch
    vocab = logits.shape[1]
    prompt = _convert_to_tensors(prompts, vocab, logits.device)
    output = _convert_to_tensors(outputs, vocab, logits.device)
    output.masked_fill_(output == -1, vocab)  # what apply_all_penalties does before yours
    got = written(
        impl.penalties.apply_penalties,
        logits.clone(),
        prompt,
        output,
        torch.tensor(pres),
        torch.tensor(freq),
        torch.tensor(rep),
    )
    want = up.penalties.apply_all_penalties(
        logits.clone(), prompt, torch.tensor(pres), torch.tensor(freq), torch.tensor(rep), outputs
    )
    diff = first_row_difference(got, want)
    assert diff is None, (
        f"Penalised logits differ from upstream's apply_all_penalties at {diff}\n"
        f"prompts {prompts}\noutputs {outputs} (-1 is padding)\npresence {pres}\n"
        f"frequency {freq}\nrepetition {rep}"
    )


@pytest.mark.upstream
@pytest.mark.points(6)
@pytest.mark.timeout(180)
@LOCKSTEP
@given(case=sampler_cases(logprobs_modes=["raw_logprobs"]))
def test_processed_logits_equal_upstreams_samplers(impl, up, case, monkeypatch):
    """Upstream's order around your code: allowed ids, bad words, min_tokens,
    your logit bias, your penalties; upstream's Sampler on its own batch."""
    plug_into_engine(impl, monkeypatch)
    from mini_vllm.oracle.sampler_workload import CONFIG
    from mini_vllm.worker.gpu_model_runner import build_logitsprocs

    mini = mini_batch(case, logitsprocs=build_logitsprocs(CONFIG, torch.device("cpu")))
    logits = case.logits[: mini.num_reqs]
    got = written(Sampler.apply_logits_processors, logits.clone(), mini.sampling_metadata)
    upstream = upstream_batch(up, case)  # after yours: an unwritten region fails without it
    want = up.Sampler().apply_logits_processors(logits.clone(), upstream.sampling_metadata, False)
    diff = first_row_difference(got, want)
    assert diff is None, (
        f"Logits after the processors every row gets differ from upstream's at {diff}\n"
        f"{describe(case, mini.req_ids)}\nThe order is allowed ids, bad words, min_tokens, "
        "logit_bias, then repetition, frequency, presence (a repetition penalty also scales a "
        "bias)."
    )
