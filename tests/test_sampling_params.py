"""Unit tests for mini_vllm.sampling_params.SamplingParams.

Rules checked:
- every bad value raises ValueError at construction, and the message names
  the offending field (so a user can tell which argument to fix);
- temperature below 1e-5 means greedy sampling, which resets top_p / top_k;
- the engine, not the user, sets eos_token_id, and ignore_eos keeps it None.
"""

from __future__ import annotations

import re

import pytest

from mini_vllm.sampling_params import SamplingParams

# --------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------

BAD_VALUES = [
    # (keyword arguments, the field the error message must name)
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),  # the range is (0, 1]: 0 excluded
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": -0.1}, "top_p"),
    ({"top_k": -2}, "top_k"),  # -1 and 0 mean "off", anything below is wrong
    ({"top_k": 2.5}, "top_k"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids"),
    ({"stop_token_ids": ["eos"]}, "stop_token_ids"),
    ({"logprobs": -2}, "logprobs"),
    ({"seed": "42"}, "seed"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"logit_bias": {"a": 1.0}}, "logit_bias"),
    ({"logit_bias": {3: "x"}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, 2.5]}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words"),
    ({"bad_words": "word"}, "bad_words"),
    ({"bad_words": [3]}, "bad_words"),
]


@pytest.mark.parametrize(("kwargs", "field"), BAD_VALUES, ids=[f"{k}" for k, _ in BAD_VALUES])
def test_bad_value_raises_value_error_naming_the_field(kwargs, field):
    """Each invalid argument is rejected at construction with a message that
    starts by naming the field."""
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**kwargs)
    assert str(excinfo.value).startswith(field), str(excinfo.value)


def test_validation_happens_before_greedy_reset():
    """A bad top_p is still an error when temperature=0 would reset it."""
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=0.0, top_p=1.5)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 1},
        {"max_tokens": None},
        {"temperature": 0.0},
        {"top_p": 1.0},
        {"top_p": 1e-6},
        {"top_k": 0},
        {"top_k": -1},
        {"top_k": 1},
        {"min_tokens": 4, "max_tokens": 4},  # equal is allowed
        {"min_tokens": 100, "max_tokens": None},  # no cap to compare with
        {"stop_token_ids": []},
        {"logprobs": -1},
        {"logprobs": 0},
        {"seed": 0},
        {"presence_penalty": 2.0},
        {"presence_penalty": -2.0},
        {"frequency_penalty": 2.0},
        {"repetition_penalty": 1e-3},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"logit_bias": {3: -100.0}},
        {"allowed_token_ids": [0]},
        {"bad_words": ["x y"]},
    ],
    ids=str,
)
def test_boundary_values_are_accepted(kwargs):
    """Values on the allowed side of each boundary construct fine and are kept."""
    params = SamplingParams(**kwargs)
    for key, value in kwargs.items():
        assert getattr(params, key) == value


def test_defaults():
    """Defaults follow upstream: random sampling, 16 tokens, no stops."""
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.min_tokens) == (1.0, 1.0, 0, 16, 0)
    assert p.stop_token_ids == [] and p.eos_token_id is None and p.all_stop_token_ids == set()
    assert not p.sampling_type_greedy


# --------------------------------------------------------------------------
# normalisation
# --------------------------------------------------------------------------


def test_greedy_resets_top_p_and_top_k():
    """temperature 0 means greedy: top_p / top_k would be meaningless, so they
    are reset to their 'off' values."""
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=5)
    assert p.sampling_type_greedy
    assert (p.top_p, p.top_k) == (1.0, 0)


def test_non_greedy_keeps_top_p_and_top_k():
    """With a normal temperature top_p / top_k are left as given."""
    p = SamplingParams(temperature=0.7, top_p=0.5, top_k=5)
    assert not p.sampling_type_greedy
    assert (p.top_p, p.top_k) == (0.5, 5)


def test_tiny_positive_temperature_is_raised_to_the_floor():
    """0 < temperature < 1e-2 is raised to 1e-2 (avoids inf/nan), which is
    not greedy, so top_p is kept."""
    p = SamplingParams(temperature=1e-3, top_p=0.5)
    assert p.temperature == 1e-2
    assert not p.sampling_type_greedy and p.top_p == 0.5


def test_seed_minus_one_means_no_seed():
    """seed=-1 is the conventional 'unseeded' and becomes None."""
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(seed=7).seed == 7


def test_stop_token_ids_are_copied_into_a_list():
    """stop_token_ids may be any iterable; the params keep their own list."""
    given = [3, 4]
    p = SamplingParams(stop_token_ids=given)
    given.append(5)
    assert p.stop_token_ids == [3, 4]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert p.all_stop_token_ids == {3, 4}


# --------------------------------------------------------------------------
# eos handling (update_from_generation_config)
# --------------------------------------------------------------------------


def test_engine_sets_eos_token_id():
    """The engine's eos id becomes eos_token_id and a stop token for min_tokens."""
    p = SamplingParams()
    p.update_from_generation_config({}, eos_token_id=2)
    assert p.eos_token_id == 2
    assert 2 in p.all_stop_token_ids


def test_ignore_eos_leaves_eos_token_id_none():
    """With ignore_eos the request must not stop on EOS, so eos_token_id stays
    None; the id is still recorded among all stop ids (for min_tokens)."""
    p = SamplingParams(ignore_eos=True)
    p.update_from_generation_config({}, eos_token_id=2)
    assert p.eos_token_id is None
    assert 2 in p.all_stop_token_ids


def test_extra_eos_ids_from_generation_config_become_stop_tokens():
    """Extra eos ids in the generation config are added to stop_token_ids
    (the primary one is handled by eos_token_id, so it is not duplicated)."""
    p = SamplingParams(stop_token_ids=[9])
    p.update_from_generation_config({"eos_token_id": [2, 3]}, eos_token_id=2)
    assert p.eos_token_id == 2
    assert sorted(p.stop_token_ids) == [3, 9]
    assert p.all_stop_token_ids == {2, 3, 9}


def test_ignore_eos_does_not_add_extra_eos_ids_as_stop_tokens():
    """With ignore_eos, generation-config eos ids do not become stop tokens."""
    p = SamplingParams(stop_token_ids=[9], ignore_eos=True)
    p.update_from_generation_config({"eos_token_id": 3}, eos_token_id=2)
    assert p.stop_token_ids == [9]
    assert p.all_stop_token_ids == {2, 3, 9}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"logit_bias": {5: 1.0, -1: 2.0}}, "token_id(s) [-1] in logit_bias"),
        ({"logit_bias": {10: 1.0}}, "token_id(s) [10] in logit_bias"),
        ({"allowed_token_ids": [0, 10]}, "allowed_token_ids contains out-of-vocab"),
    ],
)
def test_token_ids_outside_the_vocabulary_are_refused(kwargs, message):
    """logit_bias and allowed_token_ids are checked against the model's vocabulary (10 here)."""
    params = SamplingParams(**kwargs)
    with pytest.raises(ValueError, match=re.escape(message)):
        params._validate_vocab(10)


def test_token_ids_inside_the_vocabulary_pass():
    SamplingParams(logit_bias={9: 1.0}, allowed_token_ids=[0, 9])._validate_vocab(10)


def test_greedy_resets_min_p():
    """As upstream: greedy sampling resets min_p with top_p and top_k."""
    assert SamplingParams(temperature=0.0, min_p=0.3).min_p == 0.0
    assert SamplingParams(temperature=0.5, min_p=0.3).min_p == 0.3
