"""mini_vllm's CUDA-graph settings without upstream: what enforce_eager turns
off, and the one-line errors on bad sizes. The dispatcher itself is graded
against upstream's in tests/upstream/test_cudagraph_dispatcher_oracle.py."""

from __future__ import annotations

import pytest

from mini_vllm.config import CompilationConfig, CUDAGraphMode, ModelConfig, VllmConfig
from mini_vllm.cudagraph_dispatcher import CudagraphDispatcher
from mini_vllm.forward_context import BatchDescriptor


def test_enforce_eager_dispatches_every_step_eagerly():
    config = VllmConfig(model_config=ModelConfig(enforce_eager=True))
    cc = config.compilation_config
    assert (cc.cudagraph_mode, cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size) == (
        CUDAGraphMode.NONE,
        [],
        0,
    )
    dispatcher = CudagraphDispatcher(config)
    dispatcher.initialize_cudagraph_keys(cc.cudagraph_mode)
    assert dispatcher.get_capture_descs() == []
    assert dispatcher.dispatch(1, uniform_decode=True) == (CUDAGraphMode.NONE, BatchDescriptor(1))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"cudagraph_capture_sizes": []}, "cudagraph_capture_sizes"),
        ({"cudagraph_capture_sizes": [4, 0]}, "cudagraph_capture_sizes"),
        ({"max_cudagraph_capture_size": 0}, "max_cudagraph_capture_size"),
        ({"cudagraph_mode": "FULL"}, "cudagraph_mode"),
        ({"cudagraph_capture_sizes": [1, 2], "max_cudagraph_capture_size": 4}, "max_cudagraph"),
    ],
)
def test_bad_settings_are_one_line_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field) as info:
        VllmConfig(compilation_config=CompilationConfig(**kwargs))
    assert "\n" not in str(info.value)
