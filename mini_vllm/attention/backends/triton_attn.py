"""The Triton attention backend: store the new K/V, then run a paged kernel.

Mirrors upstream ``vllm/v1/attention/backends/triton_attn.py``
(``TritonAttentionImpl`` :396, its ``forward`` :526 and
``do_kv_cache_update`` :720) at v0.22.1.
Left out: the metadata builder (our model runner fills
``AttentionMetadata`` itself), FP8/quantized caches, cascade attention,
ALiBi, soft-capping, sinks, encoder attention, output
quantization and CUDA-graph padding.

Routing differs from upstream, which always calls one "unified" kernel and
lets it pick a 2D or split-KV (3D) launch. Here:

- every request has ``q_len == 1`` (``max_query_len == 1``): the split-KV
  decode kernel (``ops/triton_decode_attention.py``);
- otherwise: the prefill kernel (``ops/triton_prefill_attention.py``) for the
  whole batch, decode rows included (a row of length 1 is just a short
  prefill).

Invariants: same results as ``TorchAttentionImpl`` (up to rounding); rows
past ``num_actual_tokens`` come back as zeros, as there; no host-device
synchronisation (routing uses the Python ints in the metadata).
"""

from __future__ import annotations

import torch

from mini_vllm.attention.backend import AttentionImpl, AttentionMetadata
from mini_vllm.attention.ops.triton_decode_attention import decode_attention
from mini_vllm.attention.ops.triton_prefill_attention import prefill_attention
from mini_vllm.attention.ops.triton_reshape_and_cache import reshape_and_cache


class TritonAttentionImpl(AttentionImpl):
    def forward(
        self, query, key, value, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        md = attn_metadata
        n = md.num_actual_tokens
        # 1. Store the new keys and values; the kernels below read them back
        #    from the cache together with the older context.
        reshape_and_cache(key[:n], value[:n], kv_cache, md.slot_mapping[:n])

        # 2. Attend. Every row up to n is written by the kernel; padding rows
        #    after it are zeroed, as the reference does.
        out = torch.empty_like(query)  # [num_tokens, num_heads, head_size]
        out[n:].zero_()
        if md.num_reqs == 0 or n == 0:
            return out
        if md.max_query_len == 1:
            decode_attention(
                out,
                query,
                kv_cache,
                md.block_table,
                md.seq_lens,
                md.query_start_loc,
                md.max_seq_len,
                self.scale,
                sliding_window=self.sliding_window,
            )
        else:
            prefill_attention(
                out,
                query,
                kv_cache,
                md.block_table,
                md.seq_lens,
                md.query_start_loc,
                md.max_query_len,
                self.scale,
                sliding_window=self.sliding_window,
            )
        return out
