"""The attention layer a model calls: paged KV cache plus a backend.

Mirrors upstream ``vllm/model_executor/layers/attention/attention.py``
(``Attention`` :177, its ``forward`` :437, ``calc_kv_scales`` :531) at
v0.22.1. Left out: KV-sharing, query scales, scales read from a checkpoint or computed (upstream's
deprecated ``calculate_kv_scales``).

An fp8 KV cache (``kv_cache_dtype="fp8"``) keeps ``key / k_scale`` and
``value / v_scale`` in e4m3, with upstream's per-layer scales ``_k_scale``
and ``_v_scale`` (1.0 unless set, as upstream's without checkpoint
scales). Upstream's kernels multiply the scales back when they read the
cache; here the layer folds them around the backend instead, which is the
same arithmetic: ``q·(k̂ k_scale) = (q k_scale)·k̂`` and
``Σ p (v̂ v_scale) = (Σ p v̂) v_scale``. So every backend that stores by a
cast to the cache's dtype and reads by a cast to float32 (torch, cpu) runs
an fp8 cache unchanged.

The model runner binds ``kv_cache`` (one tensor per layer, see
``mini_vllm.attention.backend``) and a backend implementation before the
first forward; each forward takes its metadata from the forward context
(its own entry, by layer name, when the model has several KV-cache groups).
``per_layer_sliding_window`` makes it a sliding-window layer (upstream's
argument of the same name): its backend sees only the last that many tokens.
With a KV connector in the forward context (Phase 15), the layer waits for
its KV to load before attention and hands its cache to the connector to
save after; either call raising is recorded in the forward context for the
runner (upstream's engine dies) and the forward goes on.

Under torch.compile (Phase 18) the layer's whole forward is one opaque
custom op, ``mini_vllm::unified_attention_with_output`` (upstream's op of
that name, :734, registered at :777, which its CPU platform always calls:
``opaque_attention_op``, vllm/platforms/cpu.py:399): Dynamo does not trace into
it, so the backend's per-request Python, the metadata and the KV-cache
write run eagerly inside the compiled graph. The op finds its layer in the
forward context's ``no_compile_layers`` and writes into ``output``.
Eagerly, the layer runs its forward directly.
"""

from __future__ import annotations

import torch
from torch import nn

from mini_vllm.attention.backend import AttentionImpl
from mini_vllm.forward_context import get_forward_context


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        prefix: str = "",
        per_layer_sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.layer_name = prefix
        self.sliding_window = per_layer_sliding_window
        self.kv_cache: torch.Tensor | None = None
        self.impl: AttentionImpl | None = None
        self.kv_cache_dtype = "auto"

    def bind(
        self, impl_cls: type[AttentionImpl], kv_cache: torch.Tensor, kv_cache_dtype: str = "auto"
    ) -> None:
        self.impl = impl_cls(
            self.num_heads,
            self.head_size,
            self.scale,
            self.num_kv_heads,
            sliding_window=self.sliding_window,
        )
        self.kv_cache = kv_cache
        self.kv_cache_dtype = kv_cache_dtype
        # upstream's set_default_quant_scales: 1.0 until a checkpoint says otherwise
        self._k_scale = torch.tensor(1.0, dtype=torch.float32, device=kv_cache.device)
        self._v_scale = torch.tensor(1.0, dtype=torch.float32, device=kv_cache.device)
        self._k_scale_float = self._v_scale_float = 1.0

    def set_kv_scales(self, k_scale: float, v_scale: float) -> None:
        """Scales for an fp8 cache (stored values are ``key / k_scale``, ``value / v_scale``)."""
        self._k_scale.fill_(k_scale)
        self._v_scale.fill_(v_scale)
        self._k_scale_float, self._v_scale_float = float(k_scale), float(v_scale)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """query [T, num_heads*head_size], key/value [T, num_kv_heads*head_size]
        -> [T, num_heads*head_size]."""
        if torch.compiler.is_compiling():  # traced: one opaque op (the docstring)
            output = torch.empty_like(query)
            torch.ops.mini_vllm.unified_attention_with_output(
                query, key, value, output, self.layer_name
            )
            return output
        if self.impl is None or self.kv_cache is None:
            raise RuntimeError(f"attention layer {self.layer_name!r} has no KV cache bound")
        context = get_forward_context()
        metadata = context.attn_metadata
        if isinstance(metadata, dict):
            metadata = metadata[self.layer_name]
        # A KV connector loads this layer's KV before attention reads the
        # cache and saves it after attention wrote this step's keys and
        # values (upstream's maybe_transfer_kv_layer, kv_transfer_utils.py:15).
        connector = context.kv_connector
        if connector is not None and connector.has_connector_metadata():
            try:
                connector.wait_for_layer_load(self.layer_name)
            except Exception as e:  # the runner reports it after the forward
                context.kv_connector_errors.setdefault("wait_for_layer_load", e)
        t = query.shape[0]
        quantized = self.kv_cache_dtype.startswith("fp8")
        # BEGIN LAB 10.3: an fp8 cache stores key / k_scale and value / v_scale
        # HINT: receives quantized, query, key, value, self._k_scale_float, self._v_scale_float;
        # HINT: leaves query, key and value as the backend must see them.
        # HINT: the backend stores key and value by a cast to the cache's dtype and reads
        # HINT: them back by a cast to float32; what is read must be multiplied by its scale
        # HINT: again: fold k_scale into the query (q·(k̂ k_scale) = (q k_scale)·k̂).
        # HINT: a cache that is not fp8 is left as it is, whatever the scales.
        if quantized:  # stored: key / k_scale, value / v_scale (see the docstring)
            query = query * self._k_scale_float
            key = key / self._k_scale_float
            value = value / self._v_scale_float
        # END LAB 10.3
        out = self.impl.forward(
            query.view(t, self.num_heads, self.head_size),
            key.view(t, self.num_kv_heads, self.head_size),
            value.view(t, self.num_kv_heads, self.head_size),
            self.kv_cache,
            metadata,
        )
        if connector is not None and connector.has_connector_metadata():
            try:
                connector.save_kv_layer(self.layer_name, self.kv_cache, metadata)
            except Exception as e:  # the save is lost; the runner reports it
                context.kv_connector_errors.setdefault("save_kv_layer", e)
        # BEGIN LAB 10.3: the values read back carry v_scale
        # HINT: receives quantized, out, self._v_scale_float; leaves out: attention over the
        # HINT: dequantized values (Σ p (v̂ v_scale) = (Σ p v̂) v_scale).
        if quantized:
            out = out * self._v_scale_float
        # END LAB 10.3
        return out.reshape(t, self.num_heads * self.head_size)


@torch.library.custom_op("mini_vllm::unified_attention_with_output", mutates_args=("output",))
def unified_attention_with_output(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
) -> None:
    """Run attention layer ``layer_name`` eagerly and write its result into ``output``."""
    layer = get_forward_context().no_compile_layers[layer_name]
    output.copy_(layer.forward(query, key, value))


@unified_attention_with_output.register_fake
def unified_attention_with_output_fake(query, key, value, output, layer_name) -> None:
    """What the trace sees: the op returns nothing and writes ``output`` in place."""
    return None
