"""Lab 06.4 — the whole sampler in upstream's order, then a real run.

Graded: the two ``LAB 06.4`` regions of ``labs/phase_06/sampler.py``
(``Sampler.apply_logits_processors``: the processors every row gets, in
order; ``Sampler.sample``: temperature, min_p, top-k / top-p and the draw
for the random rows); then, as whole-phase checks, every Phase 06 region of
yours at once inside mini_vllm's engine on SmolLM2-135M.

First the order's rules on one row each; then generated mixed batches
(every sampling parameter, seeds, logprobs in each of upstream's four
``logprobs_mode``s) through your ``Sampler`` and the pinned upstream's
(vllm/v1/sample/sampler.py:20) from the same logits and seed: the same
processed logits, logits entering top-k / top-p, tokens and logprobs.
Then SmolLM2: a seeded request gives the same tokens alone and inside a
batch, and the repetition penalty and logit bias pick the tokens
transformers' own processors pick on the engine's raw logits.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from phase06_helpers import plug_into_engine, processor, written

from mini_vllm.engine.llm_engine import LLMEngine
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.grading.checks import lab_settings
from mini_vllm.oracle.sampler_workload import (
    SamplerCase,
    describe,
    first_row_difference,
    mini_batch,
    sampler_cases,
    upstream_batch,
)
from mini_vllm.sample.logits_processor import BatchUpdate
from mini_vllm.sampling_params import SamplingParams

LOCKSTEP = lab_settings(40)
NEG_INF = float("-inf")


def one_row(params: dict, prompt=(0,), output=(), bad_words=(), vocab=6, logits=None):
    """The reference's persistent batch holding one request; and its logits."""
    full = {"temperature": 0.0, "max_tokens": 16, **params}
    row = torch.tensor([1.0, 0.5, -1.0, 2.0, 0.0, -0.5][:vocab]) if logits is None else logits
    case = SamplerCase(vocab, [(full, list(bad_words), list(prompt), list(output))], [], row)
    return mini_batch(case).sampling_metadata, row.view(1, vocab)


# ------------------------------------------------------------------ the rules


@pytest.mark.points(3)
def test_the_order_of_the_processors_every_row_gets(impl):
    process = impl.sampler.Sampler.apply_logits_processors
    meta, logits = one_row({"logit_bias": {0: 2.0}, "repetition_penalty": 2.0}, prompt=[0])
    got = written(process, logits.clone(), meta)[0, 0]
    assert float(got) == pytest.approx(1.5), (
        f"Token 0 (logit 1.0, in the prompt) with logit_bias +2 and repetition_penalty 2: got "
        f"{float(got)}, want 1.5 = (1.0 + 2) / 2. The bias (a logits processor) comes before the "
        "penalties, so the repetition penalty scales the biased logit (penalty first: 2.5)."
    )
    meta, logits = one_row({"allowed_token_ids": [0, 1], "logit_bias": {3: 100.0}})
    got = written(process, logits.clone(), meta)[0]
    assert got[3] == NEG_INF and got[2] == NEG_INF, (
        f"allowed_token_ids [0, 1] and logit_bias {{3: +100}}: got {got.tolist()}; token 3 is "
        "not allowed, so it stays -inf: the allowed list is applied first and -inf + 100 is -inf."
    )
    meta, logits = one_row({"min_tokens": 2, "logit_bias": {1: 100.0}}, output=[4])
    got = written(process, logits.clone(), meta)[0]
    assert got[1] == NEG_INF, (
        f"min_tokens 2 with one output token: EOS (id 1) must be -inf even with a +100 bias on "
        f"it; got {got.tolist()}."
    )
    meta, logits = one_row({}, output=[2, 5], bad_words=[[5, 3], [0]])
    got = written(process, logits.clone(), meta)[0]
    assert got[3] == NEG_INF and got[0] == NEG_INF and got[4] == logits[0, 4], (
        f"bad words [5, 3] and [0] after output [2, 5]: got {got.tolist()}; token 3 completes "
        "[5, 3] and token 0 is a one-token bad word, both -inf; the rest untouched."
    )


@pytest.mark.points(3)
def test_temperature_before_min_p_and_greedy_rows_stay_greedy(impl):
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -3.0, -4.0])
    meta, row = one_row({"temperature": 0.5, "min_p": 0.1}, logits=logits)
    sampler = impl.sampler.Sampler("processed_logits")
    tokens, processed = written(sampler.sample, row.clone(), meta)
    scaled = row[0] / 0.5
    probs = scaled.softmax(-1)
    want = torch.where(probs < 0.1 * probs.max(), NEG_INF, scaled)
    assert torch.equal(processed[0], want), (
        f"temperature 0.5 then min_p 0.1 on {logits.tolist()}: the logits the draw used are "
        f"{processed[0].tolist()}, want {want.tolist()}: divide by the temperature first, then "
        "min_p masks by the temperature-scaled probabilities (unscaled it would keep token 2)."
    )
    assert int(tokens[0]) in (0, 1), f"drew token {int(tokens[0])}, which min_p removed"

    case = SamplerCase(
        6,
        [
            ({"temperature": 0.0, "max_tokens": 16}, [], [0], []),
            ({"temperature": 1.0, "top_k": 1, "max_tokens": 16}, [], [0], []),
        ],
        [],
        torch.tensor([[0.0, 3.0, 1.0, 0.0, 0.0, 0.0], [5.0, 0.0, 0.0, 0.0, 0.0, 0.0]]),
    )
    meta = mini_batch(case).sampling_metadata
    tokens, processed = written(
        impl.sampler.Sampler("processed_logits").sample, case.logits.clone(), meta
    )
    assert torch.equal(processed[0], case.logits[0]), (
        f"The greedy row's logits after sample() are {processed[0].tolist()}, want "
        f"{case.logits[0].tolist()}: beside random rows a greedy row (temperature 0) is divided "
        "by 1, never by its temperature (0 would give inf and nan)."
    )
    assert tokens.tolist() == [1, 0], (
        f"A greedy row (temperature 0) beside a random one (top_k 1): got tokens "
        f"{tokens.tolist()}, want [1, 0]. The greedy row takes its argmax; its temperature 0 "
        "must not divide (use 1 for rows below 1e-5), and torch.where keeps its greedy token."
    )


# ------------------------------------------------------------------ against upstream


def _recording(call, record: list):
    def run(logits, *args):
        record.append(logits.clone())
        return call(logits, *args)

    return run


@pytest.mark.upstream
@pytest.mark.points(8)
@pytest.mark.timeout(240)
@LOCKSTEP
@given(case=sampler_cases())
def test_your_sampler_equals_upstreams_on_mixed_batches(impl, up, case):
    mini = mini_batch(case)
    n, mode = mini.num_reqs, case.logprobs_mode
    logits = case.logits[:n]
    where = describe(case, mini.req_ids)
    got = written(
        impl.sampler.Sampler.apply_logits_processors, logits.clone(), mini.sampling_metadata
    )
    upstream = upstream_batch(up, case)  # after yours: an unwritten region fails without it
    want = up.Sampler().apply_logits_processors(logits.clone(), upstream.sampling_metadata, False)
    diff = first_row_difference(got, want)
    assert diff is None, (
        f"apply_logits_processors: the logits differ from upstream's at {diff}\n{where}"
    )
    for seed in (0, 1):
        mine_seen, up_seen = [], []
        mine, theirs = impl.sampler.Sampler(mode), up.Sampler(mode)
        mine.topk_topp_sampler = _recording(mine.topk_topp_sampler, mine_seen)
        theirs.topk_topp_sampler.forward = _recording(theirs.topk_topp_sampler.forward, up_seen)
        torch.manual_seed(seed)
        out = written(mine, logits.clone(), mini.sampling_metadata)
        torch.manual_seed(seed)
        up_out = theirs(logits.clone(), upstream.sampling_metadata)
        assert len(mine_seen) == len(up_seen), (
            f"top-k/top-p ran {len(mine_seen)} times, upstream's {len(up_seen)} (it runs once "
            f"when some row samples at random, never for an all-greedy batch)\n{where}"
        )
        for a, b in zip(mine_seen, up_seen, strict=True):
            diff = first_row_difference(a, b)
            assert diff is None, (
                f"The logits entering top-k/top-p (after temperature and min_p) differ at "
                f"{diff}\n{where}"
            )
        want_tokens = up_out.sampled_token_ids.view(-1).tolist()
        assert out.sampled_token_ids.tolist() == want_tokens, (
            f"seed {seed}: tokens {out.sampled_token_ids.tolist()}, upstream's {want_tokens}"
            f"\n{where}"
        )
        lp = up_out.logprobs_tensors
        assert (out.logprobs is None) == (lp is None), f"logprobs asked or not\n{where}"
        for row, (ids, vals, rank) in enumerate(out.logprobs or []):
            vals, want_vals = torch.tensor(vals), lp.logprobs[row]
            assert ids == lp.logprob_token_ids[row].tolist() and torch.equal(
                vals.nan_to_num(nan=7.0), want_vals.nan_to_num(nan=7.0)
            ), (
                f"row {row} logprobs ({mode}): yours {ids} {vals.tolist()}, upstream "
                f"{lp.logprob_token_ids[row].tolist()} {want_vals.tolist()}\n{where}"
            )
            assert rank == int(lp.selected_token_ranks[row]), f"row {row} rank\n{where}"


# ------------------------------------------------------------------ SmolLM2


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_path):
    """SmolLM2 loaded once into a reference engine that reports raw logits
    (``logprobs_mode="raw_logits"``, no cap on logprobs)."""
    llm = LLM(
        smollm2_path,
        max_model_len=128,
        max_num_seqs=4,
        kv_cache_memory_bytes=32 << 20,
        dtype="float32",
        max_logprobs=-1,
        logprobs_mode="raw_logits",
    )
    return llm.llm_engine


def every_region_written(impl) -> None:
    """Fail at once if a Phase 06 region still raises NotImplementedError,
    before SmolLM2 runs: a few cheap calls that reach every region."""
    params = {"temperature": 0.8, "top_k": 3, "min_p": 0.1, "max_tokens": 16}
    case = SamplerCase(6, [(params, [], [0], [])], [], torch.zeros(1, 6))
    written(impl.sampler.Sampler(), case.logits.clone(), mini_batch(case).sampling_metadata)
    ones = torch.ones(1)
    written(
        impl.penalties.apply_penalties, torch.zeros(1, 4), *[torch.tensor([[0]])] * 2, *[ones] * 3
    )
    written(impl.topk_topp_sampler.apply_top_k_top_p, torch.zeros(1, 4), None, torch.tensor([0.5]))
    written(impl.topk_topp_sampler.apply_top_k_only, torch.zeros(1, 4), torch.tensor([2]))
    written(impl.builtin.process_dict_updates, {}, BatchUpdate(1, [], [], []), lambda *_: None)
    min_p = processor(impl.builtin.MinPLogitsProcessor)
    added = [(0, SamplingParams(min_p=0.5), [0], []), (1, SamplingParams(min_p=0.5), [0], [])]
    written(min_p.update_state, BatchUpdate(2, [], added, []))
    written(min_p.update_state, BatchUpdate(1, [1], [], []))
    written(min_p.apply, torch.zeros(1, 4))
    bias = processor(impl.builtin.LogitBiasLogitsProcessor)
    bias.update_state(BatchUpdate(1, [], [(0, SamplingParams(logit_bias={0: 1.0}), [0], [])], []))
    written(bias.apply, torch.zeros(1, 4))


def your_engine(impl, monkeypatch, reference) -> LLMEngine:
    """An engine on the reference's SmolLM2 weights, running your Phase 06 pieces."""
    plug_into_engine(impl, monkeypatch)
    config = dataclasses.replace(
        reference.vllm_config,
        cache_config=dataclasses.replace(reference.vllm_config.cache_config),
    )
    engine = LLMEngine(config, (reference.model, reference.hf_config, reference.tokenizer))
    runner = engine.engine_core.model_runner
    assert type(runner.sampler) is impl.sampler.Sampler, "the engine must run your Sampler"
    return engine


def run(engine, requests: list[tuple[str, str, SamplingParams]]) -> dict[str, object]:
    """Each request's finished output (token ids, logprobs), by id."""
    for req_id, text, params in requests:
        engine.add_request(req_id, text, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in written(engine.step):
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return done


SEEDED = SamplingParams(
    temperature=0.8,
    top_k=50,
    top_p=0.9,
    min_p=0.05,
    repetition_penalty=1.2,
    presence_penalty=0.3,
    seed=1234,
    max_tokens=8,
    ignore_eos=True,
)
TEXT = "Once upon a time, in a small village by the sea,"


@pytest.mark.phase
@pytest.mark.points(5)
@pytest.mark.timeout(600)
def test_smollm2_seeded_tokens_alone_equal_tokens_in_a_batch(impl, request, monkeypatch):
    every_region_written(impl)  # before SmolLM2 runs
    reference = request.getfixturevalue("smollm2_reference")
    engine = your_engine(impl, monkeypatch, reference)
    alone = run(engine, [("alone", TEXT, SEEDED)])["alone"].token_ids
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    penalised = SamplingParams(
        temperature=1.3, frequency_penalty=1.0, logit_bias={13: 3.0}, seed=7, max_tokens=6
    )
    batched = run(
        engine,
        [
            ("greedy", TEXT, greedy),
            ("unseeded", "Write a list of fruits:", SamplingParams(temperature=1.0, max_tokens=5)),
            ("seeded", TEXT, SEEDED),
            ("penalised", "Repeat: la la la la", penalised),
        ],
    )
    tokenizer = reference.tokenizer
    got = batched["seeded"].token_ids
    assert got == alone, (
        f"SmolLM2, seed 1234 (temperature 0.8, top_k 50, top_p 0.9, min_p 0.05, penalties): "
        f"alone {alone} {tokenizer.decode(alone)!r}, third of four in a batch {got} "
        f"{tokenizer.decode(got)!r}. A seeded row draws from its own generator, and every "
        "other step is per row: its tokens must not depend on its neighbours."
    )
    assert batched["greedy"].token_ids != alone, (
        "the seeded run must really sample: it gave the greedy tokens"
    )


@pytest.mark.phase
@pytest.mark.points(5)
@pytest.mark.timeout(600)
def test_smollm2_penalties_pick_what_transformers_processors_pick(impl, request, monkeypatch):
    """Greedy SmolLM2 with a repetition penalty and a logit bias: at every
    step the engine's token must be the argmax of transformers'
    ``SequenceBiasLogitsProcessor`` then ``RepetitionPenaltyLogitsProcessor``
    (the order transformers' ``generate`` builds them in, and upstream's:
    bias first, then penalties) applied to the engine's raw logits
    (``logprobs_mode="raw_logits"``, every token).

    Where the definitions agree: the repetition penalty reads prompt and
    output in both, divides positive logits and multiplies negative ones
    (vLLM multiplies by the reciprocal: a last-bit difference, so steps whose
    top two are closer than 1e-4 are not compared); a one-token sequence bias
    is a logit bias. Where they differ (not compared): transformers has no
    frequency or presence penalty (OpenAI's definitions, in vLLM only), and
    its min_new_tokens blocks only EOS where vLLM's min_tokens blocks every
    stop token id."""
    from transformers.generation.logits_process import (
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
    )

    every_region_written(impl)  # before SmolLM2 runs
    reference = request.getfixturevalue("smollm2_reference")
    engine = your_engine(impl, monkeypatch, reference)
    tokenizer = reference.tokenizer
    text = "Repeat after me: the cat sat on the mat, the cat sat on the mat, the cat"
    bias_token = tokenizer.encode(" dog", add_special_tokens=False)[0]
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    penalised = SamplingParams(
        temperature=0.0,
        max_tokens=8,
        ignore_eos=True,
        repetition_penalty=1.3,
        logit_bias={bias_token: 4.0},
        logprobs=-1,
    )
    outs = run(engine, [("plain", text, plain), ("penalised", text, penalised)])
    tokens = outs["penalised"].token_ids
    assert tokens != outs["plain"].token_ids, (
        f"The penalties should change SmolLM2's greedy text here: both gave {tokens} "
        f"{tokenizer.decode(tokens)!r} (is the repetition penalty or the bias applied?)"
    )
    prompt = tokenizer.encode(text, add_special_tokens=False)
    bias = SequenceBiasLogitsProcessor({(bias_token,): 4.0})
    repetition = RepetitionPenaltyLogitsProcessor(1.3)
    compared = 0
    for i, (tok, entry) in enumerate(zip(tokens, outs["penalised"].logprobs, strict=True)):
        raw = torch.full((1, len(entry)), NEG_INF)
        raw[0, list(entry)] = torch.tensor(list(entry.values()))
        history = torch.tensor([prompt + tokens[:i]])
        scores = repetition(history, bias(history, raw.clone()))[0]
        top2 = scores.topk(2).values
        if float(top2[0] - top2[1]) < 1e-4:
            continue
        compared += 1
        want = int(scores.argmax())
        assert tok == want, (
            f"SmolLM2 step {i} after {tokenizer.decode(tokens[:i])!r}: your engine chose {tok} "
            f"{tokenizer.decode([tok])!r}, transformers' bias + repetition processors on the same "
            f"raw logits choose {want} {tokenizer.decode([want])!r}. Repetition reads prompt AND "
            "output; the bias is added before the penalty."
        )
    assert compared >= len(tokens) - 2, f"only {compared} of {len(tokens)} steps were comparable"
