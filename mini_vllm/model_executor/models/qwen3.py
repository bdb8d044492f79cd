"""Qwen3 (dense): Llama's architecture plus an RMSNorm on every query and key head.

Mirrors upstream ``vllm/model_executor/models/qwen3.py`` at v0.22.1
(``Qwen3Attention`` at :59, ``Qwen3DecoderLayer`` at :165,
``Qwen3ForCausalLM`` at :261). Left out: everything llama.py leaves out,
plus dual-chunk attention. Upstream builds Qwen3 on its Qwen2 classes;
here it reuses mini_vllm's Llama ones, which differ from Qwen2 only where
Qwen3 overrides them anyway.

What Qwen3 changes relative to Llama:

- ``q_norm`` / ``k_norm``: each head's query and key vector is
  RMS-normalized (one weight of size ``head_dim``, shared by all heads)
  after the projection and *before* RoPE;
- ``head_dim`` is explicit in the config and need not equal
  ``hidden_size / num_attention_heads`` (Qwen3-0.6B: 16 heads of 128 on a
  1024 hidden size);
- RoPE theta defaults to 1e6 (transformers fills it into the config).
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from mini_vllm.model_executor.layers.layernorm import RMSNorm
from mini_vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from mini_vllm.model_executor.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
)


class Qwen3Attention(LlamaAttention):
    def __init__(
        self,
        config: PretrainedConfig,
        prefix: str = "",
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__(config, prefix, quant_config)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        t = qkv.shape[0]
        # Normalize per head: view [T, heads * head_dim] as [T, heads, head_dim].
        q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim)).reshape(t, self.q_size)
        k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).reshape(t, self.kv_size)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Qwen3DecoderLayer
