"""Fixtures shared by Phase 11's graded suites (helpers: phase11_helpers.py).

- ``up``: the pinned upstream's scheduler backend (mini_vllm/oracle/upstream.py),
  whose ``Scheduler`` Lab 11.1 runs beside yours;
- ``up_ops``: upstream's own torch shrink/expand ops
  (vllm/lora/ops/torch_ops/lora_ops.py), what Lab 11.2 is graded against;
- ``up_punica``: upstream's ``PunicaWrapperCPU`` and ``LoRAMapping``
  (vllm/lora/punica_wrapper/punica_cpu.py:22), with the host-to-device copy
  told not to pin memory (pinning needs CUDA), for Lab 11.4's layer checks.

Lab 11.4's folder adds the SmolLM2 adapters in its own ``conftest.py``.
"""

from __future__ import annotations

import functools
import os

import pytest

os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")


@pytest.fixture(scope="session")
def up():
    from mini_vllm.oracle import upstream

    return upstream


@pytest.fixture(scope="session")
def up_ops():
    import vllm.lora.ops.torch_ops as ops

    return ops


@pytest.fixture(scope="session")
def up_punica():
    import vllm.lora.punica_wrapper.utils as utils
    from vllm.lora.layers.utils import LoRAMapping
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    if not isinstance(utils.async_tensor_h2d, functools.partial):
        utils.async_tensor_h2d = functools.partial(utils.async_tensor_h2d, pin_memory=False)
    return PunicaWrapperCPU, LoRAMapping
