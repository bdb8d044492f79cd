"""fp8 and int8 linear layers against float32, within bounds derived from the formats.

The bounds are worked out from how each format rounds, not fitted to runs:

- e4m3 (fp8) has 3 mantissa bits: rounding a value in the normal range
  moves it by at most 2^-4 of itself; subnormals (below 2^-6 before scaling)
  sit on a grid of 2^-9, so they move by at most 2^-10. With a scale ``s``
  (``x ≈ q * s``) that is ``|x - x̂| <= max(2^-4 |x|, 2^-10 s)``;
- int8 with ``s = amax / 127`` rounds to the nearest multiple of ``s``:
  ``|w - ŵ| <= s / 2``;
- a dot product of quantized factors then errs by at most
  ``Σ |x̂ - x| |w| + |x| |ŵ - w| + |x̂ - x| |ŵ - w|``, plus float32
  accumulation (``K * 2^-24`` of ``Σ |x̂| |ŵ|`` for the run and for the
  reference, and a few roundings of the scaling).

Every linear layer of a tiny seeded model (and, in the deep tier, of
SmolLM2) is checked against those bounds during a real forward (its own
input, the float32 weights); the logits' error and greedy agreement over 16
teacher-forced steps are measured and reported as counters, not asserted
(how errors grow through softmax and norms is not a format property).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_models import PagedKV, Seq, run_step

from mini_vllm.model_executor.layers.linear import LinearBase
from mini_vllm.model_executor.layers.quantization.fp8 import Fp8Config, Fp8OnlineLinearMethod
from mini_vllm.model_executor.layers.quantization.int8 import quantize_int8_per_channel
from mini_vllm.model_executor.model_loader import load_model, smollm2_gguf_path
from mini_vllm.model_executor.model_loader.tiny import make_tiny_model

U8 = 2.0**-4  # e4m3: half the relative spacing of normal numbers
SUB8 = 2.0**-10  # e4m3: half the subnormal spacing
FP8_MAX = 448.0
F32 = 2.0**-24
# "The capital of France is Paris. The capital of Germany is" in SmolLM2's tokens
SMOLLM2_PROMPT = [504, 3575, 282, 4649, 314, 7042, 30, 378, 3575, 282, 4521, 314]


def fp8_error(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The largest |v - v̂| e4m3 rounding allows, per element."""
    return torch.maximum(U8 * v.abs(), SUB8 * scale)


def dot_bound(x, w, ex, ew, xq, wq) -> torch.Tensor:
    """Largest |x̂ ŵ^T - x w^T| given per-element errors ex, ew, plus float32 rounding."""
    first = ex @ w.abs().t() + x.abs() @ ew.t() + ex @ ew.t()
    k = x.shape[-1]
    accumulate = 2 * k * F32 * (xq.abs() @ wq.abs().t()) + 2 * k * F32 * (x.abs() @ w.abs().t())
    return first + accumulate


def test_fp8_weight_rounding_within_format_bound():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g) * torch.logspace(-8, 2, 96).unsqueeze(1)
    for per_channel in (False, True):
        layer = LinearBase(64, [96])
        layer.weight.data.copy_(w)
        method = Fp8OnlineLinearMethod(Fp8Config(weight_per_channel=per_channel))
        method.process_weights_after_loading(layer)
        assert layer.weight.dtype == torch.float8_e4m3fn
        scale = layer.weight_scale.view(-1, 1)  # [1, 1] or [96, 1]
        assert scale.shape[0] == (96 if per_channel else 1)
        w_hat = layer.weight.float() * scale
        err = (w_hat - w).abs()
        assert (err <= fp8_error(w, scale) * (1 + 4 * F32)).all()
        assert err.max() > 0  # it did quantize


def test_int8_weight_rounding_within_format_bound():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 64, generator=g) * torch.logspace(-4, 1, 48).unsqueeze(1)
    w[7] = 0.0
    q, scale = quantize_int8_per_channel(w)
    assert q.dtype == torch.int8 and scale.shape == (48, 1)
    err = (q.float() * scale - w).abs()
    assert (err <= scale / 2 * (1 + 4 * F32)).all()
    assert (err.amax(dim=1) > 0).sum() >= 40


# --------------------------------------------------------------------------
# A tiny model, quantized three ways, against its float32 self.
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("quant") / "tiny-llama", "llama", seed=0)


@pytest.fixture(
    scope="module",
    params=[
        "tiny-llama",
        # SmolLM2 (30 layers, hidden 576): about 70 s on 2 busy cores for the
        # three methods (a float32 load, three quantized loads, 17 steps each).
        pytest.param("smollm2", marks=pytest.mark.deep),
    ],
)
def reference(request, tiny_llama):
    """(name, checkpoint path, its float32 model)."""
    path = smollm2_gguf_path() if request.param == "smollm2" else tiny_llama
    return request.param, path, load_model(path, load_tokenizer=False).model


def layer_bound(method_name, x, w, layer, out_hat):
    """The format bound for one quantized layer's output on input x."""
    if method_name == "int8_per_channel":
        ew = (layer.weight_scale / 2).expand_as(w)
        w_hat = layer.weight.float() * layer.weight_scale
        bound = dot_bound(x, w, torch.zeros_like(x), ew, x, w_hat)
    else:
        x_scale = (x.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1 / (FP8_MAX * 512))
        w_scale = layer.weight_scale.view(-1, 1)
        ex, ew = fp8_error(x, x_scale), fp8_error(w, w_scale)
        x_hat = x + ex  # only magnitudes matter for the accumulation term
        w_hat = layer.weight.float() * w_scale
        bound = dot_bound(x, w, ex, ew, x_hat, w_hat)
    return bound + 4 * F32 * out_hat.abs()  # the scale multiplications


@pytest.mark.parametrize("method_name", ["fp8", "fp8_per_channel", "int8_per_channel"])
def test_every_layer_within_format_bound_in_a_real_run(reference, method_name, counts):
    model_name, path, ref = reference
    quant = load_model(path, quantization=method_name, load_tokenizer=False).model
    weights = dict(ref.named_modules())
    want = torch.float8_e4m3fn if method_name.startswith("fp8") else torch.int8
    checked = []

    def check(module, inputs, output):
        (x,) = inputs
        w = weights[module.prefix].weight.float()
        exact = F.linear(x.float(), w)
        bound = layer_bound(method_name, x.float(), w, module, output.float())
        excess = ((output.float() - exact).abs() - bound).max().item()
        assert excess <= 0, f"{module.prefix}: error exceeds the {method_name} bound by {excess}"
        checked.append(module.prefix)

    hooks = [m.register_forward_hook(check) for m in quant.modules() if isinstance(m, LinearBase)]
    for m in quant.modules():
        if isinstance(m, LinearBase):
            assert m.weight.dtype == want, m.prefix
    prompt = list(range(3, 60)) if model_name == "tiny-llama" else SMOLLM2_PROMPT
    sq, sr = Seq(PagedKV(quant)), Seq(PagedKV(ref))
    (lq,) = run_step(quant, [(sq, prompt)])
    (lr,) = run_step(ref, [(sr, prompt)])
    for h in hooks:
        h.remove()
    assert len(checked) == 4 * ref.config.num_hidden_layers
    # Measured, not asserted: logit error and greedy agreement over 16 steps.
    agree, worst = 0, (lq - lr).abs().max().item() / lr.abs().max().item()
    tq = tr = int(lr[-1].argmax())
    for _ in range(16):
        (lq,) = run_step(quant, [(sq, [tr])])
        (lr,) = run_step(ref, [(sr, [tr])])
        tq, tr = int(lq[-1].argmax()), int(lr[-1].argmax())
        agree += tq == tr
        worst = max(worst, (lq - lr).abs().max().item() / lr.abs().max().item())
    counts[f"quantization: {model_name} {method_name} max |logit err| (relative)"] = f"{worst:.2e}"
    counts[f"quantization: {model_name} {method_name} greedy agreement"] = f"{agree}/16"


def test_online_quantization_shrinks_linear_weights(tiny_llama):
    def linear_bytes(model):
        layers = [m for m in model.modules() if isinstance(m, LinearBase)]
        total = sum(p.numel() * p.element_size() for m in layers for p in m.parameters())
        return total, sum(m.output_size for m in layers)

    ref, outputs = linear_bytes(load_model(tiny_llama).model)
    for name in ("fp8", "fp8_per_channel", "int8_per_channel"):
        quant, _ = linear_bytes(load_model(tiny_llama, quantization=name).model)
        # a byte a weight instead of four, plus float32 scales (at most one per output)
        assert ref / 4 < quant <= ref / 4 + 4 * outputs, name
