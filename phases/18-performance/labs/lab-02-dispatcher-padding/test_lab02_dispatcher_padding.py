"""Lab 18.2 — the CUDA-graph dispatcher: which graph runs a step, padded to what.

Graded: the ``LAB 18.2`` regions of ``labs/phase_18/cudagraph_dispatcher.py``.

Against upstream's ``CudagraphDispatcher`` (vllm/v1/cudagraph_dispatcher.py:15),
live on this CPU, the harness of tests/upstream/test_cudagraph_dispatcher_oracle.py:
upstream's VllmConfig turns CUDA graphs off on a CPU, so its mode is forced
back and its capture sizes recomputed, as a GPU runner would see them. Your
dispatcher and upstream's get the same config (max_num_seqs, token budget,
mode, capture sizes); they must agree on the padded size of every batch
size, the graphs to capture, and the (mode, key) ``dispatch`` returns for
every token count up to past the largest size, decode-only or not, under each
set of allowed modes upstream's runner passes.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from mini_vllm.config import (
    CompilationConfig,
    CUDAGraphMode,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from mini_vllm.grading.checks import lab_settings, written

pytestmark = [pytest.mark.upstream, pytest.mark.timeout(60)]

MODES = list(CUDAGraphMode)
# The allowed-mode sets upstream's runner passes (gpu_model_runner.py:3766).
ALLOWED = [
    (None, None),
    (None, {"FULL"}),
    ({"NONE", "PIECEWISE"}, None),
    ({"NONE", "FULL"}, None),
    ({"FULL", "PIECEWISE"}, None),
]
SIZES = [1, 2, 4, 8, 16, 32]


def upstream_dispatcher(max_num_seqs, max_num_batched_tokens, mode, sizes):
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    from vllm.config import CUDAGraphMode as UpMode
    from vllm.config import DeviceConfig
    from vllm.config import ModelConfig as UpModelConfig
    from vllm.config import SchedulerConfig as UpSchedulerConfig
    from vllm.config import VllmConfig as UpVllmConfig
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher as UpDispatcher

    from mini_vllm.oracle import upstream as oracle  # noqa: F401 (the stand-in model)

    vllm_config = UpVllmConfig(
        model_config=UpModelConfig(
            model=oracle._model_dir, skip_tokenizer_init=True, max_model_len=4096, dtype="float32"
        ),
        scheduler_config=UpSchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=4096,
            is_encoder_decoder=False,
        ),
        device_config=DeviceConfig(device="cpu"),
    )
    dispatcher = UpDispatcher(vllm_config)  # built while the mode is still NONE
    cc = vllm_config.compilation_config
    cc.cudagraph_mode = UpMode[mode.name]
    cc.cudagraph_capture_sizes = None if sizes is None else list(sizes)
    cc.max_cudagraph_capture_size = None
    vllm_config._set_cudagraph_sizes()
    dispatcher.initialize_cudagraph_keys(UpMode[mode.name])
    return dispatcher


def your_dispatcher(impl, max_num_seqs, max_num_batched_tokens, mode, sizes, initialize=True):
    vllm_config = VllmConfig(
        model_config=ModelConfig(max_model_len=4096),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
        ),
        compilation_config=CompilationConfig(
            cudagraph_mode=mode, cudagraph_capture_sizes=None if sizes is None else list(sizes)
        ),
    )
    dispatcher = impl.cudagraph_dispatcher.CudagraphDispatcher(vllm_config)
    if initialize:
        written(dispatcher.initialize_cudagraph_keys, mode)
    return dispatcher


def key(desc) -> tuple:
    return (desc.num_tokens, desc.num_reqs, desc.uniform)


def dispatch(dispatcher, mode_cls, num_tokens, uniform, valid, invalid):
    """(mode name, key), or "AssertionError" (both assert when no graph fits
    and NONE is not allowed)."""
    try:
        mode, desc = written(
            dispatcher.dispatch,
            num_tokens,
            uniform,
            valid_modes=None if valid is None else {mode_cls[n] for n in valid},
            invalid_modes=None if invalid is None else {mode_cls[n] for n in invalid},
        )
    except AssertionError:
        return "AssertionError"
    return mode.name, key(desc)


def case(max_num_seqs, max_num_batched_tokens, mode, sizes) -> str:
    return (
        f"max_num_seqs={max_num_seqs}, max_num_batched_tokens={max_num_batched_tokens}, "
        f"mode={mode.name}, cudagraph_capture_sizes={sizes}"
    )


def compare(impl, max_num_seqs, max_num_batched_tokens, mode, sizes, what=("pad", "keys", "all")):
    from vllm.config import CUDAGraphMode as UpMode

    where = case(max_num_seqs, max_num_batched_tokens, mode, sizes)
    got = your_dispatcher(impl, max_num_seqs, max_num_batched_tokens, mode, sizes, False)
    want = upstream_dispatcher(max_num_seqs, max_num_batched_tokens, mode, sizes)
    if "pad" in what:
        if want.compilation_config.max_cudagraph_capture_size:
            written(got._compute_bs_to_padded_graph_size)
            assert got._bs_to_padded_graph_size == want._bs_to_padded_graph_size, (
                f"_bs_to_padded_graph_size (the size each batch size pads to), {where}:\n"
                f"  yours:    {got._bs_to_padded_graph_size}\n"
                f"  upstream: {want._bs_to_padded_graph_size}"
            )
    written(got.initialize_cudagraph_keys, mode)
    if "keys" in what:
        want_capture = [(m.name, [key(d) for d in ds]) for m, ds in want.get_capture_descs()]
        got_capture = [(m.name, [key(d) for d in ds]) for m, ds in got.get_capture_descs()]
        assert got_capture == want_capture, (
            f"the graphs to capture (mode, [(num_tokens, num_reqs, uniform)]), {where}:\n"
            f"  yours:    {got_capture}\n  upstream: {want_capture}"
        )
    if "all" in what:
        top = (want.compilation_config.max_cudagraph_capture_size or 0) + 3
        for num_tokens in range(1, top + 1):
            for uniform in (False, True):
                for valid, invalid in ALLOWED:
                    expected = dispatch(want, UpMode, num_tokens, uniform, valid, invalid)
                    actual = dispatch(got, CUDAGraphMode, num_tokens, uniform, valid, invalid)
                    assert actual == expected, (
                        f"dispatch({num_tokens}, uniform_decode={uniform}, valid_modes={valid}, "
                        f"invalid_modes={invalid}), {where}:\n"
                        f"  yours:    {actual}\n  upstream: {expected}"
                    )


@pytest.mark.points(2)
def test_three_pads_to_four(impl):
    """The padded size of every batch size, sizes 1, 2, 4, 8, 16, 32."""
    compare(impl, 32, 2048, CUDAGraphMode.FULL, SIZES, what=("pad",))


@pytest.mark.points(1)
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_the_graphs_to_capture(impl, mode):
    """initialize_cudagraph_keys in every mode: the keys, as get_capture_descs lists them."""
    compare(impl, 8, 2048, mode, SIZES, what=("keys",))


@pytest.mark.points(1)
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_dispatch_in_every_mode(impl, mode):
    """Every token count 1..35, decode-only or not, every allowed-mode set:
    padded below 32, NONE above, FULL before PIECEWISE."""
    compare(impl, 32, 2048, mode, SIZES)


@pytest.mark.points(1)
@pytest.mark.parametrize("max_num_seqs, max_num_batched_tokens", [(3, 5), (100, 8192), (7, 7)])
def test_upstreams_default_sizes(impl, max_num_seqs, max_num_batched_tokens):
    """No sizes given: upstream's default list, capped by the config."""
    compare(impl, max_num_seqs, max_num_batched_tokens, CUDAGraphMode.FULL_AND_PIECEWISE, None)


@pytest.mark.points(5)
@lab_settings(60)
@given(
    max_num_seqs=st.sampled_from([1, 2, 3, 8, 16, 100]) | st.integers(1, 300),
    max_num_batched_tokens=st.sampled_from([64, 256, 512, 2048]) | st.integers(8, 1024),
    mode=st.sampled_from(MODES),
    sizes=st.none() | st.lists(st.integers(1, 300), min_size=1, max_size=8),
)
def test_generated_configs_dispatch_as_upstream(
    impl, max_num_seqs, max_num_batched_tokens, mode, sizes
):
    assume(max_num_seqs <= max_num_batched_tokens)  # both configs refuse fewer tokens than seqs
    compare(impl, max_num_seqs, max_num_batched_tokens, mode, sizes)
