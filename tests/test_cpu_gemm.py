"""The CPU GEMM dispatch (mini_vllm/model_executor/layers/utils.py).

- once a model is loaded on a CPU, every unquantized linear layer and the
  embedding table that makes the logits run their matmul through oneDNN over
  a packed copy of the weight (upstream's ``dispatch_cpu_unquantized_gemm``);
- that matmul computes what ``F.linear`` computes, for any number of rows,
  with and without a bias, on 2-D and 3-D inputs, in float32 and bfloat16;
- a layer never dispatched (built outside the loader) still runs ``F.linear``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mini_vllm.entrypoints.llm import LLM
from mini_vllm.model_executor.layers.linear import LinearBase
from mini_vllm.model_executor.layers.utils import (
    cpu_unquantized_gemm,
    dispatch_cpu_unquantized_gemm,
)
from mini_vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from mini_vllm.model_executor.model_loader.tiny import make_tiny_model

needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN"
)


@needs_onednn
def test_a_loaded_models_matmuls_are_dispatched(tmp_path):
    llm = LLM(str(make_tiny_model(tmp_path / "m", arch="llama")), max_model_len=64, device="cpu")
    model = llm.llm_engine.engine_core.model_runner.model
    layers = [m for m in model.modules() if isinstance(m, (LinearBase, VocabParallelEmbedding))]
    plain = [type(m).__name__ for m in layers if m.__dict__.get("cpu_linear", F.linear) is F.linear]
    assert layers and not plain, f"layers left on F.linear after loading: {plain}"


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_the_dispatched_matmul_is_f_linear(dtype, bias):
    torch.manual_seed(0)
    layer = torch.nn.Linear(96, 160, bias=bias, dtype=dtype)
    dispatch_cpu_unquantized_gemm(layer)
    assert layer.cpu_linear is not F.linear
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for shape in [(1, 96), (7, 96), (33, 96), (3, 5, 96)]:
        x = torch.randn(shape, dtype=dtype)
        got = cpu_unquantized_gemm(layer, x, layer.weight, layer.bias)
        want = F.linear(x, layer.weight, layer.bias)
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want, **tol)


def test_an_undispatched_layer_runs_f_linear():
    layer = torch.nn.Linear(8, 4, bias=False)
    x = torch.randn(3, 8)
    assert torch.equal(cpu_unquantized_gemm(layer, x, layer.weight), F.linear(x, layer.weight))


@needs_onednn
def test_a_weight_changed_after_packing_is_not_served_stale():
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 32, bias=False)
    dispatch_cpu_unquantized_gemm(layer)
    x = torch.randn(5, 64)
    with torch.no_grad():
        layer.weight.mul_(2.0)  # in place: the packed copy holds the old values
    torch.testing.assert_close(cpu_unquantized_gemm(layer, x, layer.weight), x @ layer.weight.T)
    layer.to(torch.bfloat16)  # cast: the packed copy is float32
    xb = x.to(torch.bfloat16)
    got = cpu_unquantized_gemm(layer, xb, layer.weight)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, F.linear(xb, layer.weight))
