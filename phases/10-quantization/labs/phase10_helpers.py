"""Helpers shared by Phase 10's graded suites: e4m3's rounding, one forward
pass over a fixed text, and your quantization pieces plugged into the loader.

(Imported by name from the suites: this folder is on sys.path because pytest
puts the folder of ``conftest.py`` there.)
"""

from __future__ import annotations

import torch

from mini_vllm.grading.checks import written  # noqa: F401 (the lab tests import it from here)

# e4m3 has 3 mantissa bits: rounding a normal value moves it by at most 2^-4
# of itself (half a step of 2^-3); subnormals (below 2^-6) sit on a grid of
# 2^-9, so they move by at most 2^-10.
U8, SUB8 = 2.0**-4, 2.0**-10
FP8_MAX = 448.0
F32 = 2.0**-24  # float32's unit roundoff
BLOCK = 16
# The fixed text of Lab 10.4: every quantized run reads the same tokens.
TEXT = (
    "The capital of France is Paris. The capital of Germany is Berlin. "
    "Water boils at one hundred degrees Celsius at sea level, and it freezes at zero."
)


def fp8_error(v: torch.Tensor, scale) -> torch.Tensor:
    """The largest |v - v̂| e4m3 rounding allows for ``v ≈ q * scale``, per element."""
    return torch.maximum(U8 * v.abs(), SUB8 * torch.as_tensor(scale, dtype=v.dtype))


def forward_logits(model, ids: list[int], kv_cache_dtype: str = "auto") -> torch.Tensor:
    """One prefill of ``ids`` (a single request, fresh paged caches, the torch
    backend): the logits at every position, [len(ids), vocab], float32."""
    from mini_vllm.attention.backend import AttentionMetadata, get_kv_cache_shape
    from mini_vllm.attention.backends.torch_attn import TorchAttentionImpl
    from mini_vllm.forward_context import set_forward_context

    n = len(ids)
    num_blocks = (n + BLOCK - 1) // BLOCK + 1  # block 0 is the null block
    dtype = torch.float8_e4m3fn if kv_cache_dtype.startswith("fp8") else torch.float32
    for layer in model.attention_layers():
        shape = get_kv_cache_shape(num_blocks, BLOCK, layer.num_kv_heads, layer.head_size)
        layer.bind(TorchAttentionImpl, torch.zeros(shape, dtype=dtype), kv_cache_dtype)
    metadata = AttentionMetadata(
        num_actual_tokens=n,
        max_query_len=n,
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        max_seq_len=n,
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_table=torch.arange(1, num_blocks, dtype=torch.int32)[None],
        slot_mapping=torch.arange(BLOCK, BLOCK + n, dtype=torch.int64),
    )
    with torch.no_grad(), set_forward_context(metadata):
        hidden = model(torch.tensor(ids, dtype=torch.int64), torch.arange(n))
        return model.compute_logits(hidden).float()


def plug_into_loader(impl, monkeypatch) -> None:
    """Make ``load_model(..., quantization=...)`` build your methods: the
    reference configs pick their method classes by name from their modules,
    so those names point at yours (your ``QuantFP8`` included)."""
    from mini_vllm.model_executor.layers.quantization import fp8, gguf, int8

    monkeypatch.setattr(fp8, "Fp8OnlineLinearMethod", impl.fp8.Fp8OnlineLinearMethod)
    monkeypatch.setattr(fp8, "QuantFP8", impl.input_quant_fp8.QuantFP8)
    monkeypatch.setattr(int8, "Int8WeightOnlyLinearMethod", impl.int8.Int8WeightOnlyLinearMethod)
    monkeypatch.setattr(gguf, "GGUFLinearMethod", impl.gguf.GGUFLinearMethod)
    monkeypatch.setattr(gguf, "GGUFEmbeddingMethod", impl.gguf.GGUFEmbeddingMethod)


def use_your_attention(impl, model) -> None:
    """Every attention layer of ``model`` runs your ``Attention.forward``."""
    for layer in model.attention_layers():
        layer.__class__ = impl.attention.Attention


def dot_bound(x, w, ex, ew, x_hat, w_hat) -> torch.Tensor:
    """The largest |x̂ ŵ^T - x w^T| for per-element errors ``ex``, ``ew``:
    ``Σ ex |w| + |x| ew + ex ew``, plus float32 accumulation over K terms
    (``K * 2^-24`` of ``Σ |x̂| |ŵ|`` for the run and of ``Σ |x| |w|`` for the reference)."""
    first = ex @ w.abs().t() + x.abs() @ ew.t() + ex @ ew.t()
    k = x.shape[-1]
    accumulate = 2 * k * F32 * (x_hat.abs() @ w_hat.abs().t() + x.abs() @ w.abs().t())
    return first + accumulate


def layer_bound(method: str, x, w, layer, out_hat) -> torch.Tensor:
    """The format's bound on one quantized layer's output error on input ``x``
    (float32 [T, in]), given the float32 weight ``w`` it was quantized from."""
    if method == "int8_per_channel":
        ew = (layer.weight_scale.float() / 2).expand_as(w)  # round to nearest: half a step
        w_hat = layer.weight.float() * layer.weight_scale.float()
        bound = dot_bound(x, w, torch.zeros_like(x), ew, x, w_hat)
    else:  # fp8: activations per token, weights per tensor or per channel
        x_scale = (x.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1 / (FP8_MAX * 512))
        w_scale = layer.weight_scale.float().view(-1, 1)
        ex, ew = fp8_error(x, x_scale), fp8_error(w, w_scale)
        w_hat = layer.weight.float() * w_scale
        bound = dot_bound(x, w, ex, ew, x + ex, w_hat)
    return bound + 4 * F32 * out_hat.abs()  # the scale multiplications


def quality(logits: torch.Tensor, reference: torch.Tensor) -> str:
    """Measured, not asserted: the logit and log-prob error per position (the
    worst position) and the greedy agreement, teacher-forced on the text."""
    logit_err = (logits - reference).abs().amax(dim=1)
    logprob_err = (logits.log_softmax(-1) - reference.log_softmax(-1)).abs().amax(dim=1)
    agree = (logits.argmax(-1) == reference.argmax(-1)).sum().item()
    return (
        f"max |logit error| per position {logit_err.max().item():.3g} (median "
        f"{logit_err.median().item():.3g}), max |log-prob error| {logprob_err.max().item():.3g}, "
        f"greedy agreement {agree}/{len(logits)} positions"
    )
