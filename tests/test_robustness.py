"""Nothing a user passes to ``LLM`` breaks the engine (issue 21).

Each case feeds one bad input or fault to a shared ``LLM`` on the tiny seeded
Qwen3 (vocabulary 512, max_position_embeddings 512, no tokenizer) and checks
two things: the error names what was wrong, and afterwards the engine is
whole. "Whole" means: no request left in the scheduler, the model runner or
the output processor, every KV block back in the free pool, and a normal
greedy request still gives transformers' tokens (``hf_greedy`` on the same
weights), so a half-written block left in the prefix cache would show.

Faults inside a step (Ctrl-C, an exception from the model) are injected by
wrapping the model runner's ``execute_model``; a second thread is held
inside ``generate`` the same way.
"""

from __future__ import annotations

import contextlib
import itertools
import threading

import pytest
from hf_reference import hf_greedy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mini_vllm.entrypoints.llm import LLM
from mini_vllm.sampling_params import SamplingParams

VOCAB = 512  # the tiny model's vocabulary and max_position_embeddings
MAX_MODEL_LEN = 128
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
NORMAL = list(range(3, 40))  # 37 tokens: two full blocks of 16, so prefix caching takes part


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    return LLM(tiny_qwen3[0], max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=8 << 20)


@pytest.fixture(scope="module")
def hf_tokens(tiny_qwen3):
    """Transformers' greedy tokens for a prompt, memoised."""
    cache: dict[tuple, list[int]] = {}

    def tokens(prompt: list[int], n: int = GREEDY.max_tokens) -> list[int]:
        key = (tuple(prompt), n)
        if key not in cache:
            cache[key] = hf_greedy(tiny_qwen3[1], prompt, n)
        return cache[key]

    return tokens


def assert_whole(llm: LLM, hf_tokens) -> None:
    """Nothing left behind, every block free, and a normal request still right."""
    engine = llm.llm_engine
    core = engine.engine_core
    scheduler = core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    for _ in range(2):  # before and after one normal request
        assert not scheduler.requests and not scheduler.running and len(scheduler.waiting) == 0
        assert not engine.output_processor.request_states
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1, "KV blocks leaked"
        (out,) = llm.generate({"prompt_token_ids": NORMAL}, GREEDY, use_tqdm=False)
        assert out.outputs[0].token_ids == hf_tokens(NORMAL)
    # The runner forgets a finished request at the next step, as upstream's does.
    assert set(core.model_runner.requests) <= scheduler.finished_req_ids


# ------------------------------------------------------------ rejected at add_request

BAD_PROMPTS = [
    ({"prompt_token_ids": [5, VOCAB]}, ValueError, "Token id 512 is out of vocabulary"),
    ({"prompt_token_ids": [5, -1]}, ValueError, "Token id -1 is out of vocabulary"),
    ({"prompt_token_ids": [5, 2**64]}, ValueError, "Token id 18446744073709551616 is out of"),
    ({"prompt_token_ids": [5, 1.5]}, ValueError, "must contain only integers, got float"),
    ({"prompt_token_ids": [5, True]}, ValueError, "must contain only integers, got bool"),
    ({"prompt_token_ids": 7}, ValueError, "prompt_token_ids must be a list of token ids"),
    ({"prompt_token_ids": []}, ValueError, "the decoder prompt cannot be empty"),
    (
        {"prompt_token_ids": [5] * MAX_MODEL_LEN},
        ValueError,
        "plus the number of requested output tokens \\(at least 1\\) is longer than the "
        f"maximum model length of {MAX_MODEL_LEN}",
    ),
    (
        {"prompt_token_ids": [5] * (MAX_MODEL_LEN + 1)},
        ValueError,
        f"\\(length {MAX_MODEL_LEN + 1}\\) is longer than the maximum model length",
    ),
    ("some text", ValueError, "This model has no tokenizer"),
    ({"text": "x"}, ValueError, "A prompt dict needs 'prompt' or 'prompt_token_ids'"),
    # Token ids under 'prompt' used to run; upstream refuses them
    # (vllm/renderers/inputs/preprocess.py:128).
    ({"prompt": [5, 6]}, ValueError, "A prompt dict's 'prompt' must be a string .*got list"),
    ({"prompt": {"prompt_token_ids": [5]}}, ValueError, "'prompt' must be a string .*got dict"),
    (7, ValueError, "prompts must be a string, a prompt dict or a list of them, got int"),
    (None, ValueError, "prompts must be a string, a prompt dict or a list of them, got NoneType"),
]


@pytest.mark.parametrize(
    ("prompt", "error", "message"), BAD_PROMPTS, ids=[repr(p)[:40] for p, _, _ in BAD_PROMPTS]
)
def test_bad_prompt_is_rejected_and_the_engine_stays_whole(llm, hf_tokens, prompt, error, message):
    with pytest.raises(error, match=message):
        llm.generate(prompt, GREEDY, use_tqdm=False)
    assert_whole(llm, hf_tokens)


@pytest.mark.parametrize(("text", "reported"), [("hello", "hello"), ("", None)])
def test_a_prompt_dict_with_text_and_ids_runs_the_ids(llm, hf_tokens, text, reported):
    """Upstream runs the ids and reports the text as given, an empty one as
    None (vllm/renderers/base.py:458, :730-731; compared live in
    tests/upstream/test_prompt_dict_oracle.py)."""
    prompt = {"prompt": text, "prompt_token_ids": NORMAL}
    (out,) = llm.generate(prompt, GREEDY, use_tqdm=False)
    assert out.prompt_token_ids == NORMAL
    assert out.outputs[0].token_ids == hf_tokens(NORMAL)
    assert out.prompt == reported
    assert_whole(llm, hf_tokens)


def test_a_bad_prompt_after_good_ones_aborts_the_good_ones(llm, hf_tokens):
    """Requests added before the bad one are taken back: nothing runs."""
    prompts = [
        {"prompt_token_ids": NORMAL},
        {"prompt_token_ids": [1, 2]},
        {"prompt_token_ids": [VOCAB]},
    ]
    with pytest.raises(ValueError, match="Request '\\d+': Token id 512 is out of vocabulary"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_whole(llm, hf_tokens)


BAD_PARAMS = [
    ({"temperature": float("nan")}, "temperature must be a finite number, got nan"),
    ({"temperature": float("inf")}, "temperature must be a finite number, got inf"),
    ({"temperature": -0.5}, "temperature must be non-negative, got -0.5"),
    ({"temperature": "0.5"}, "temperature must be a number, got str"),
    ({"top_p": float("nan")}, "top_p must be a finite number, got nan"),
    ({"max_tokens": 2.5}, "max_tokens must be an integer, got float 2.5"),
    ({"max_tokens": "3"}, "max_tokens must be an integer, got str"),
    ({"max_tokens": 0}, "max_tokens must be at least 1, got 0"),
    ({"min_tokens": 1.0}, "min_tokens must be an integer, got float"),
    ({"logprobs": 2.0}, "logprobs must be an integer, got float"),
    ({"seed": 2**64}, "seed must be in \\[-9223372036854775808, 9223372036854775807\\]"),
    ({"seed": -(2**63) - 1}, "seed must be in"),
    ({"seed": 1.5}, "seed must be an integer, got float"),
    ({"stop": 5}, "stop must be a string or a list of strings, got int"),
    ({"stop": [1]}, "stop must contain only strings"),
    ({"stop_token_ids": 2}, "stop_token_ids must be a list of integers, got int"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_PARAMS, ids=[str(k) for k, _ in BAD_PARAMS])
def test_bad_sampling_params_are_rejected_at_construction(llm, hf_tokens, kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
    assert_whole(llm, hf_tokens)


@pytest.mark.parametrize(
    ("logprobs", "message"),
    [
        (21, "Requested sample logprobs of 21, which is greater than max allowed: 20"),
        (-1, f"Requested sample logprobs of {VOCAB}, which is greater than max allowed: 20"),
    ],
)
def test_logprobs_above_max_logprobs_are_rejected(llm, hf_tokens, logprobs, message):
    params = SamplingParams(max_tokens=3, logprobs=logprobs)
    with pytest.raises(ValueError, match=message):
        llm.generate({"prompt_token_ids": NORMAL}, params, use_tqdm=False)
    assert_whole(llm, hf_tokens)


PROMPT_56 = {"prompt_token_ids": [5, 6]}


def test_logprobs_above_the_vocabulary_are_rejected_even_without_a_cap(tiny_qwen3, hf_tokens):
    uncapped = LLM(tiny_qwen3[0], max_model_len=64, kv_cache_memory_bytes=4 << 20, max_logprobs=-1)
    with pytest.raises(
        ValueError, match=f"of {VOCAB + 1}, which is greater than max allowed: {VOCAB}"
    ):
        uncapped.generate(
            PROMPT_56, SamplingParams(max_tokens=2, logprobs=VOCAB + 1), use_tqdm=False
        )
    (out,) = uncapped.generate(PROMPT_56, SamplingParams(max_tokens=2, logprobs=-1), use_tqdm=False)
    assert all(len(step) == VOCAB for step in out.outputs[0].logprobs)  # -1 is all of them
    assert_whole(uncapped, hf_tokens)


def test_params_that_are_not_sampling_params_are_a_type_error(llm, hf_tokens):
    with pytest.raises(TypeError, match="params must be a SamplingParams, but got dict"):
        llm.generate({"prompt_token_ids": NORMAL}, [{"temperature": 0}], use_tqdm=False)
    assert_whole(llm, hf_tokens)


BAD_SPECULATIVE_CONFIGS = [
    ({"num_speculative_tokens": "3"}, "num_speculative_tokens must be an integer, got str '3'"),
    ({"num_speculative_tokens": 2.5}, "num_speculative_tokens must be an integer, got float"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens must be an integer, got bool"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be at least 1, got 0"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"num_speculative_tokens": 3, "method": 5}, "method must be 'ngram' .*got 5"),
    ({"num_speculative_tokens": 3, "method": "eagle"}, "method must be 'ngram' .*got 'eagle'"),
    (
        {"num_speculative_tokens": 3, "prompt_lookup_min": "2"},
        "prompt_lookup_min must be an integer, got str '2'",
    ),
    (
        {"num_speculative_tokens": 3, "prompt_lookup_max": [4]},
        "prompt_lookup_max must be an integer, got list",
    ),
    ({"num_speculative_tokens": 3, "prompt_lookup_max": 0}, "prompt_lookup_max must be at least 1"),
    (
        {"num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
        "prompt_lookup_min \\(4\\) must be <= prompt_lookup_max \\(2\\)",
    ),
    ({"num_speculative_tokens": 3, "draft_model": "x"}, "unsupported keys \\['draft_model'\\]"),
    ([3], " must be a dict with keys from"),
]


@pytest.mark.parametrize(
    ("spec", "message"), BAD_SPECULATIVE_CONFIGS, ids=[repr(s) for s, _ in BAD_SPECULATIVE_CONFIGS]
)
def test_bad_speculative_config_is_refused_naming_the_field_before_loading(spec, message):
    """One line naming the field, as SamplingParams' checks; the model path does
    not exist, so an error about the config proves it was checked first."""
    with pytest.raises(ValueError, match=f"speculative_config.*{message}") as err:
        LLM("/nonexistent/model", speculative_config=spec)
    assert "\n" not in str(err.value)


def test_max_model_len_beyond_the_position_embeddings_is_refused(tiny_qwen3, llm, hf_tokens):
    with pytest.raises(
        ValueError,
        match=f"max_model_len \\({VOCAB + 1}\\) is greater than .*max_position_embeddings={VOCAB}",
    ):
        LLM(tiny_qwen3[0], max_model_len=VOCAB + 1, kv_cache_memory_bytes=8 << 20)
    assert_whole(llm, hf_tokens)


# ------------------------------------------------------------------ faults in a step


@contextlib.contextmanager
def before_execute_model(llm: LLM, hook):
    """Call ``hook(n)`` before the model runner's n-th execute_model (n from 1):
    a hook that raises does so before the forward pass, so the blocks that
    step was to fill stay unwritten."""
    runner = llm.llm_engine.engine_core.model_runner
    execute_model = runner.execute_model
    calls = itertools.count(1)

    def wrapped(scheduler_output, *args):
        hook(next(calls))
        return execute_model(scheduler_output, *args)

    runner.execute_model = wrapped
    try:
        yield
    finally:
        del runner.execute_model  # back to the class's method


def raise_at(at: int, error: BaseException):
    def hook(call: int) -> None:
        if call == at:
            raise error

    return hook


@pytest.mark.parametrize("at", [1, 3], ids=["during prefill", "during decode"])
def test_ctrl_c_during_generate_aborts_everything(llm, hf_tokens, at):
    """Ctrl-C mid-generate: the KeyboardInterrupt reaches the caller, every request
    is aborted, and the prompt's blocks (cached when allocated, never written
    when the interrupt came first) are out of the prefix cache: the same prompt
    run again gives transformers' tokens."""
    prompt = list(range(100, 140))  # its own two full blocks, not NORMAL's
    prompts = [{"prompt_token_ids": prompt}, {"prompt_token_ids": NORMAL[:20]}]
    with before_execute_model(llm, raise_at(at, KeyboardInterrupt())):
        with pytest.raises(KeyboardInterrupt) as err:
            llm.generate(prompts, GREEDY, use_tqdm=False)
    assert any("generate() aborted its 2 requests" in note for note in err.value.__notes__)
    (out,) = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == hf_tokens(prompt)
    assert_whole(llm, hf_tokens)


@pytest.mark.parametrize(
    "engine_kwargs",
    [{"async_scheduling": True}, {"speculative_config": {"num_speculative_tokens": 2}}],
    ids=["async scheduling, a step in flight", "n-gram drafts"],
)
def test_ctrl_c_with_async_scheduling_or_drafts_leaves_the_llm_whole(
    tiny_qwen3, hf_tokens, engine_kwargs
):
    """The same promise with two steps in flight (the interrupt comes out of the
    worker thread's future) and with drafts pending in the scheduler."""
    llm = LLM(
        tiny_qwen3[0], max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=8 << 20, **engine_kwargs
    )
    prompt = list(range(100, 140))
    prompts = [{"prompt_token_ids": prompt}, {"prompt_token_ids": NORMAL[:20]}]
    with before_execute_model(llm, raise_at(3, KeyboardInterrupt())):
        with pytest.raises(KeyboardInterrupt) as err:
            llm.generate(prompts, GREEDY, use_tqdm=False)
    assert any("generate() aborted its 2 requests" in note for note in err.value.__notes__)
    (out,) = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == hf_tokens(prompt)
    assert_whole(llm, hf_tokens)


def test_an_exception_inside_a_step_fails_its_requests_with_a_note(llm, hf_tokens):
    with before_execute_model(llm, raise_at(2, RuntimeError("CUDA error: device-side assert"))):
        with pytest.raises(RuntimeError, match="device-side assert") as err:
            llm.generate({"prompt_token_ids": NORMAL}, GREEDY, use_tqdm=False)
    assert any("the LLM is ready for the next call" in note for note in err.value.__notes__)
    assert_whole(llm, hf_tokens)


def test_a_second_thread_calling_generate_gets_a_clear_error(llm, hf_tokens):
    """One generate at a time: the second caller is refused at once (it used to
    share the engine loop and could hang or lose outputs); the first finishes right."""
    inside, release = threading.Event(), threading.Event()
    first: list = []

    def hold(call: int) -> None:
        inside.set()
        release.wait(timeout=60)

    def run_first():
        first.extend(llm.generate({"prompt_token_ids": NORMAL}, GREEDY, use_tqdm=False))

    with before_execute_model(llm, hold):
        thread = threading.Thread(target=run_first)
        thread.start()
        try:
            assert inside.wait(timeout=60)
            with pytest.raises(
                RuntimeError, match="LLM.generate is already running in another thread"
            ):
                llm.generate({"prompt_token_ids": [5, 6]}, GREEDY, use_tqdm=False)
        finally:
            release.set()
            thread.join(timeout=60)
    assert not thread.is_alive()
    assert first[0].outputs[0].token_ids == hf_tokens(NORMAL)
    assert_whole(llm, hf_tokens)


# -------------------------------------------------------------------- random junk

JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=-3, max_value=VOCAB + 3),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3),
    st.lists(st.integers(min_value=-3, max_value=VOCAB + 3), max_size=3),
)
PARAM_NAMES = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "ignore_eos",
)
TOKEN_IDS = st.lists(
    st.one_of(st.integers(min_value=-2, max_value=VOCAB + 2), st.floats(), st.booleans()),
    max_size=MAX_MODEL_LEN + 2,
)
PROMPTS = st.one_of(
    TOKEN_IDS,
    st.lists(st.integers(min_value=0, max_value=VOCAB - 1), min_size=1, max_size=60),
    st.fixed_dictionaries({"prompt_token_ids": st.one_of(TOKEN_IDS, JUNK)}),
    JUNK,
)


@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,  # the same examples on every run: CI never flakes on a new one
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    params=st.dictionaries(st.sampled_from(PARAM_NAMES), JUNK, max_size=4),
    max_tokens=st.integers(min_value=1, max_value=8),
    prompts=st.lists(PROMPTS, min_size=1, max_size=3),
)
def test_random_junk_never_breaks_the_engine(llm, hf_tokens, params, max_tokens, prompts):
    """Junk sampling parameters and prompts: each is refused with a ValueError
    or runs to the end; either way the engine is whole afterwards."""
    params.setdefault("max_tokens", max_tokens)
    try:
        sampling_params = SamplingParams(**params)
    except ValueError:
        sampling_params = SamplingParams(max_tokens=max_tokens)
    sampling_params.max_tokens = min(sampling_params.max_tokens or 8, 8)  # keep it cheap
    try:
        outputs = llm.generate(prompts, sampling_params, use_tqdm=False)
    except ValueError:
        pass
    else:
        for out in outputs:
            assert all(0 <= t < VOCAB for t in out.outputs[0].token_ids)
            assert 1 <= len(out.outputs[0].token_ids) <= sampling_params.max_tokens
    assert_whole(llm, hf_tokens)
