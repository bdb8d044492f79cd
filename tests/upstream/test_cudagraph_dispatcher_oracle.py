"""Live oracle: mini_vllm's CUDA-graph dispatcher (mini_vllm/cudagraph_dispatcher.py)
and capture sizes (``VllmConfig._set_cudagraph_sizes``) against the pinned
upstream's ``CudagraphDispatcher`` and ``VllmConfig._set_cudagraph_sizes``.

On a CPU upstream's VllmConfig turns CUDA graphs off (the platform has
none), so the mode is forced back afterwards and upstream's own size rule
is run again, before the keys are built, as its GPU runner would build them.
Hypothesis draws (max_num_seqs, max_num_batched_tokens, mode, given capture
sizes or upstream's default list, a given largest size); both sides must
agree on the sizes, the graphs to capture, and the (mode, padded key) of
every token count up to past the largest size, decode-only or not, under
each set of allowed modes the runner passes. LoRA is off on both sides.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mini_vllm.config import (
    CompilationConfig,
    CUDAGraphMode,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from mini_vllm.cudagraph_dispatcher import CudagraphDispatcher
from mini_vllm.tiers import examples

pytestmark = pytest.mark.upstream

MODES = list(CUDAGraphMode)
# The allowed-mode sets upstream's runner passes (gpu_model_runner.py:3766):
# everything, everything but FULL (cascade attention), and forced ones.
ALLOWED = [
    (None, None),
    (None, {"FULL"}),
    ({"NONE", "PIECEWISE"}, None),
    ({"NONE", "FULL"}, None),
    ({"FULL", "PIECEWISE"}, None),
]


def _upstream_dispatcher(max_num_seqs, max_num_batched_tokens, mode, sizes, largest):
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    from vllm.config import CUDAGraphMode as UpMode
    from vllm.config import DeviceConfig
    from vllm.config import ModelConfig as UpModelConfig
    from vllm.config import SchedulerConfig as UpSchedulerConfig
    from vllm.config import VllmConfig as UpVllmConfig
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher as UpDispatcher

    from mini_vllm.oracle import upstream as oracle  # noqa: F401 (registers the stand-in model)

    model_config = UpModelConfig(
        model=oracle._model_dir, skip_tokenizer_init=True, max_model_len=4096, dtype="float32"
    )
    vllm_config = UpVllmConfig(
        model_config=model_config,
        scheduler_config=UpSchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=4096,
            is_encoder_decoder=False,
        ),
        device_config=DeviceConfig(device="cpu"),
    )
    # Built while the mode is NONE: its piecewise-compilation assertion
    # holds a GPU build's compilation settings this CPU build has not got.
    dispatcher = UpDispatcher(vllm_config)
    cc = vllm_config.compilation_config
    cc.cudagraph_mode = UpMode[mode.name]
    cc.cudagraph_capture_sizes = None if sizes is None else list(sizes)
    cc.max_cudagraph_capture_size = largest
    vllm_config._set_cudagraph_sizes()
    dispatcher.initialize_cudagraph_keys(UpMode[mode.name])
    return dispatcher


def _mini_dispatcher(max_num_seqs, max_num_batched_tokens, mode, sizes, largest):
    vllm_config = VllmConfig(
        model_config=ModelConfig(max_model_len=4096),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
        ),
        compilation_config=CompilationConfig(
            cudagraph_mode=mode,
            cudagraph_capture_sizes=None if sizes is None else list(sizes),
            max_cudagraph_capture_size=largest,
        ),
    )
    dispatcher = CudagraphDispatcher(vllm_config)
    dispatcher.initialize_cudagraph_keys(mode)
    return dispatcher


def _key(desc) -> tuple:
    return (desc.num_tokens, desc.num_reqs, desc.uniform)


def _modes(names, mode_cls):
    return None if names is None else {mode_cls[n] for n in names}


def _dispatch(dispatcher, mode_cls, num_tokens, uniform, valid, invalid):
    """(mode name, key) or the error's class name (both sides assert when no
    graph fits and NONE is not allowed)."""
    try:
        mode, desc = dispatcher.dispatch(
            num_tokens,
            uniform,
            valid_modes=_modes(valid, mode_cls),
            invalid_modes=_modes(invalid, mode_cls),
        )
    except AssertionError:
        return "AssertionError"
    return mode.name, _key(desc)


def _compare(max_num_seqs, max_num_batched_tokens, mode, sizes, largest):
    from vllm.config import CUDAGraphMode as UpMode

    case = dict(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        mode=mode.name,
        sizes=sizes,
        largest=largest,
    )
    try:
        want = _upstream_dispatcher(max_num_seqs, max_num_batched_tokens, mode, sizes, largest)
    except ValueError:
        # Both sizes and a contradicting largest size given: upstream refuses.
        with pytest.raises(ValueError, match="max_cudagraph_capture_size"):
            _mini_dispatcher(max_num_seqs, max_num_batched_tokens, mode, sizes, largest)
        return
    got = _mini_dispatcher(max_num_seqs, max_num_batched_tokens, mode, sizes, largest)

    want_cc, got_cc = want.compilation_config, got.compilation_config
    assert got_cc.cudagraph_capture_sizes == want_cc.cudagraph_capture_sizes, case
    assert got_cc.max_cudagraph_capture_size == want_cc.max_cudagraph_capture_size, case
    want_capture = [(m.name, [_key(d) for d in ds]) for m, ds in want.get_capture_descs()]
    got_capture = [(m.name, [_key(d) for d in ds]) for m, ds in got.get_capture_descs()]
    assert got_capture == want_capture, f"graphs to capture differ for {case}"

    top = (want_cc.max_cudagraph_capture_size or 0) + 3
    for num_tokens in range(1, top + 1):
        for uniform in (False, True):
            for valid, invalid in ALLOWED:
                expected = _dispatch(want, UpMode, num_tokens, uniform, valid, invalid)
                actual = _dispatch(got, CUDAGraphMode, num_tokens, uniform, valid, invalid)
                assert actual == expected, (
                    f"dispatch({num_tokens}, uniform_decode={uniform}, valid_modes={valid}, "
                    f"invalid_modes={invalid}) gave {actual}, upstream {expected}, for {case}"
                )


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_three_pads_to_four_and_none_above_the_largest(mode):
    """The issue's example, in every mode: sizes 1, 2, 4, 8, 16, 32."""
    _compare(32, 2048, mode, [1, 2, 4, 8, 16, 32], None)


@pytest.mark.parametrize(
    "max_num_seqs, max_num_batched_tokens",
    [(256, 300), (3, 5), (100, 8192), (512, 8192), (7, 7)],
)
@pytest.mark.parametrize("mode", [CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY], ids=str)
def test_default_sizes(max_num_seqs, max_num_batched_tokens, mode):
    """Upstream's default list at its edges: below 8, the step from 8 to 16
    at 256, the 512 cap, and a token budget that fits under the largest size
    (captured although off the stride)."""
    _compare(max_num_seqs, max_num_batched_tokens, mode, None, None)


@settings(max_examples=examples(200, 25), deadline=None, derandomize=True)
@given(
    max_num_seqs=st.sampled_from([1, 2, 3, 8, 16, 100, 256]) | st.integers(1, 300),
    max_num_batched_tokens=st.sampled_from([64, 256, 512, 2048]) | st.integers(8, 1024),
    mode=st.sampled_from(MODES),
    sizes=st.none() | st.lists(st.integers(1, 600), min_size=1, max_size=8),
    largest=st.none() | st.integers(1, 600),
)
def test_dispatch_matches_upstream(max_num_seqs, max_num_batched_tokens, mode, sizes, largest):
    assume(max_num_seqs <= max_num_batched_tokens)  # both configs refuse fewer tokens than seqs
    _compare(max_num_seqs, max_num_batched_tokens, mode, sizes, largest)
