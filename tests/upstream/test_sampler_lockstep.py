"""The engine's sampler against the pinned upstream's ``Sampler``, on CPU.

Both sides build their persistent batch the way the runner does
(DESIGN.md, Phase 06): ``SamplingParams`` -> ``update_from_generation_config``
-> ``InputBatch.add_request`` (then removals and ``condense``, so rows move)
-> ``refresh_metadata`` -> ``Sampler(logits, input_batch.sampling_metadata)``.
Hypothesis generates batches mixing every parameter mini_vllm supports
(temperature, top_k, top_p, min_p, the three penalties, logit_bias,
allowed_token_ids, bad words, min_tokens, seeds, logprobs) over prompts and
outputs; from the same logits and the same global seed the two sides must
give bit-identical processed logits (``apply_logits_processors``), the same
tokens, and the same logprobs, ids and ranks, in each of upstream's four
``logprobs_mode``s (raw or processed, logits or logprobs; both samplers are
built with the case's mode). Upstream's batch gets its
built-in processors (min_tokens, logit_bias, min_p); mini's gets the
runner's ``build_logitsprocs``. The penalties module's
``is_pin_memory_available`` returns False (no CUDA here). The upstream
platform here is unspecified, so upstream draws with ``forward_native``,
the path mini mirrors. MINI_VLLM_SAMPLING_EXAMPLES sets the number of cases
(default 40).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mini_vllm.oracle.sampler_workload import (
    describe,
    first_row_difference,
    mini_batch,
    sampler_cases,
    upstream_batch,
    upstream_sampling,
)
from mini_vllm.sample.sampler import Sampler
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.tiers import examples

pytestmark = pytest.mark.upstream

EXAMPLES = examples(40, 20, "MINI_VLLM_SAMPLING_EXAMPLES")
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def up():
    return upstream_sampling()


def _tensor(value):
    return None if value is None else value.tolist()


def _metadata_fields(meta, num_reqs: int, all_greedy_temperature: bool) -> dict:
    """The fields both sides fill, in a form both share."""
    return {
        "all_greedy": meta.all_greedy,
        "all_random": meta.all_random,
        # Upstream leaves the temperature out when every row is greedy.
        "temperature": None if all_greedy_temperature else _tensor(meta.temperature),
        "top_k": _tensor(meta.top_k),
        "top_p": _tensor(meta.top_p),
        "generator rows": sorted(meta.generators),
        "max_num_logprobs": meta.max_num_logprobs,
        "no_penalties": meta.no_penalties,
        "prompt_token_ids": _tensor(meta.prompt_token_ids),
        "penalties": None
        if meta.no_penalties
        else [
            _tensor(meta.frequency_penalties),
            _tensor(meta.presence_penalties),
            _tensor(meta.repetition_penalties),
        ],
        "output_token_ids": [list(o) for o in meta.output_token_ids],
        "allowed_token_ids_mask": _tensor(meta.allowed_token_ids_mask),
        "bad_words_token_ids": dict(sorted(meta.bad_words_token_ids.items())),
    }


def _recording(call, record: list):
    """``call`` (the top-k/top-p sampler), also keeping a copy of the logits it receives."""

    def run(logits, *args):
        record.append(logits.clone())
        return call(logits, *args)

    return run


@SETTINGS
@given(case=sampler_cases())
def test_sampler_matches_upstream_on_mixed_batches(up, case):
    mini, upstream = mini_batch(case), upstream_batch(up, case)
    assert mini.req_ids == upstream.req_ids
    n, mode = mini.num_reqs, case.logprobs_mode
    logits = case.logits[:n].clone()
    where = describe(case, mini.req_ids)

    meta = mini.sampling_metadata
    mine = _metadata_fields(meta, n, meta.all_greedy)
    theirs = _metadata_fields(upstream.sampling_metadata, n, meta.all_greedy)
    assert mine == theirs, where

    got = Sampler.apply_logits_processors(logits.clone(), mini.sampling_metadata)
    want = up.Sampler().apply_logits_processors(logits.clone(), upstream.sampling_metadata, False)
    diff = first_row_difference(got, want)
    assert diff is None, f"processed logits differ at {diff}\n{where}"

    for seed in (0, 1):
        mini_seen, up_seen = [], []
        mini_sampler, up_sampler = Sampler(mode), up.Sampler(mode)
        mini_sampler.topk_topp_sampler = _recording(mini_sampler.topk_topp_sampler, mini_seen)
        forward = up_sampler.topk_topp_sampler.forward
        up_sampler.topk_topp_sampler.forward = _recording(forward, up_seen)
        torch.manual_seed(seed)
        out = mini_sampler(logits.clone(), mini.sampling_metadata)
        torch.manual_seed(seed)
        up_out = up_sampler(logits.clone(), upstream.sampling_metadata)
        # What reaches top-k / top-p: after temperature and min_p (random rows only).
        assert len(mini_seen) == len(up_seen), where
        for got_seen, want_seen in zip(mini_seen, up_seen, strict=True):
            diff = first_row_difference(got_seen, want_seen)
            assert diff is None, f"logits entering top-k/top-p differ at {diff}\n{where}"
        want_tokens = up_out.sampled_token_ids.view(-1).tolist()
        assert out.sampled_token_ids.tolist() == want_tokens, f"seed {seed}\n{where}"
        lp = up_out.logprobs_tensors
        if lp is None:
            assert out.logprobs is None
            continue
        for row, (ids, vals, rank) in enumerate(out.logprobs):
            assert ids == lp.logprob_token_ids[row].tolist(), (row, where)
            # A row whose every token is masked has NaN logprobs in the processed modes.
            vals, want_vals = torch.tensor(vals), lp.logprobs[row]
            assert torch.equal(vals.nan_to_num(nan=7.0), want_vals.nan_to_num(nan=7.0)), (
                f"row {row} logprobs: mini {vals.tolist()} upstream {want_vals.tolist()}\n{where}"
            )
            assert rank == int(lp.selected_token_ranks[row]), (row, where)


@pytest.mark.parametrize(
    "words", [["hello"], [" world", "New York"], ["the", "Paris!", "  spaced"]]
)
def test_bad_words_become_the_same_token_ids_as_upstream(up, words):
    """mini's ``update_from_tokenizer`` against upstream's on SmolLM2's tokenizer."""
    from transformers import AutoTokenizer
    from vllm.tokenizers.hf import get_cached_tokenizer

    from mini_vllm.model_executor.model_loader import smollm2_gguf_path

    path = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    mini = SamplingParams(bad_words=words)
    mini.update_from_tokenizer(tokenizer)
    theirs = up.SamplingParams(bad_words=words)
    theirs.update_from_tokenizer(get_cached_tokenizer(tokenizer))
    assert mini.bad_words_token_ids == theirs.bad_words_token_ids


def test_upstreams_other_sampling_fields_are_refused_by_name(up):
    """Every field of upstream's ``SamplingParams`` that mini_vllm leaves out
    (``n``, ``prompt_logprobs``, ``structured_outputs``, ...) is refused with
    an error naming it, never silently ignored; and mini has no field
    upstream lacks."""
    import dataclasses

    mini_fields = {f.name for f in dataclasses.fields(SamplingParams)}
    theirs = set(up.SamplingParams.__struct_fields__)
    assert mini_fields <= theirs, sorted(mini_fields - theirs)
    left_out = sorted(theirs - mini_fields)
    assert "n" in left_out and "prompt_logprobs" in left_out, left_out
    for name in left_out:
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{name}'"):
            SamplingParams(**{name: None})


# Per field: values upstream accepts, then values on the wrong side of its bounds.
BOUNDS = {
    "temperature": ([0.0, 1e-6, 0.005, 1.0], [-1e-6, -1.0]),
    "top_p": ([1.0, 0.5, 1e-6], [0.0, -0.1, 1.0001]),
    "top_k": ([0, -1, 1, 50], [-2]),
    "min_p": ([0.0, 0.5, 1.0], [-0.01, 1.01]),
    "presence_penalty": ([0.0, -2.0, 2.0], [-2.01, 2.01]),
    "frequency_penalty": ([0.0, -2.0, 2.0], [-2.01, 2.01]),
    "repetition_penalty": ([1.0, 1e-3, 2.0], [0.0, -1.0]),
    "max_tokens": ([16, 1, None], [0, -1]),
    "min_tokens": ([0, 1, 16], [17, -1]),
    "logprobs": ([None, 0, 5, -1], [-2]),
    "bad_words": ([None, ["a"]], [["a", ""]]),
    "stop": ([None, "x"], [["x", ""]]),
}


@st.composite
def sampling_kwargs(draw):
    """Accepted values for every field but one, which takes any of its values."""
    kwargs = {k: draw(st.sampled_from(good)) for k, (good, _) in BOUNDS.items()}
    if kwargs["max_tokens"] is not None and kwargs["min_tokens"] > kwargs["max_tokens"]:
        kwargs["min_tokens"] = 0
    field = draw(st.sampled_from(sorted(BOUNDS)))
    good, bad = BOUNDS[field]
    kwargs[field] = draw(st.sampled_from(good + bad))
    return kwargs


@settings(max_examples=300, deadline=None, derandomize=True)
@given(kwargs=sampling_kwargs())
def test_sampling_params_refuse_exactly_what_upstream_refuses(up, kwargs):
    """mini's ``SamplingParams`` raises ValueError exactly when upstream's raises
    one (its ``VLLMValidationError`` is a ValueError), on values straddling
    every bound of upstream's ``_verify_args`` (vllm/sampling_params.py:452)."""

    def refused(cls) -> bool:
        try:
            cls(**kwargs)
        except ValueError:
            return True
        return False

    assert refused(SamplingParams) == refused(up.SamplingParams), kwargs
