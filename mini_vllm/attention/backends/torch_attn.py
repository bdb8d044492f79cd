"""Reference paged attention in plain torch: the definition the kernels must meet.

Plays the role of upstream's attention backends (for example
``vllm/v1/attention/backends/triton_attn.py``) with none of their speed:
it gathers each request's keys and values out of the paged cache and runs
ordinary causal attention (torch's ``scaled_dot_product_attention``), one
request at a time, in float32. Left out:
everything that makes a backend fast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mini_vllm.attention.backend import AttentionImpl, AttentionMetadata


class TorchAttentionImpl(AttentionImpl):
    def forward(self, query, key, value, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        n = attn_metadata.num_actual_tokens
        block_size = kv_cache.shape[2]
        # 1. Store the new keys and values in their slots.
        slots = attn_metadata.slot_mapping[:n]
        blocks, offsets = slots // block_size, slots % block_size
        kv_cache[blocks, 0, offsets] = key[:n].to(kv_cache.dtype)
        kv_cache[blocks, 1, offsets] = value[:n].to(kv_cache.dtype)

        # 2. Attend, request by request: the query rows are the last q_len
        #    positions of a sequence of seq_len tokens, so row r (position
        #    seq_len - q_len + r) may see key positions 0 .. seq_len - q_len + r.
        #    softmax(q k^T * scale + mask) v, with KV head h // group serving
        #    query head h (GQA), is exactly what SDPA computes with enable_gqa.
        out = torch.zeros_like(query)
        starts = attn_metadata.query_start_loc.tolist()
        seq_lens = attn_metadata.seq_lens.tolist()
        for i, seq_len in enumerate(seq_lens):
            q = query[starts[i]:starts[i + 1]].float().transpose(0, 1)  # [H, q_len, D]
            q_len = q.shape[1]
            num_blocks = -(-seq_len // block_size)
            table = attn_metadata.block_table[i, :num_blocks].long()
            k = kv_cache[table, 0].reshape(-1, self.num_kv_heads, self.head_size)[:seq_len]
            v = kv_cache[table, 1].reshape(-1, self.num_kv_heads, self.head_size)[:seq_len]
            mask = None
            if q_len > 1:
                q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
                mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(
                q, k.float().transpose(0, 1), v.float().transpose(0, 1),
                attn_mask=mask, scale=self.scale, enable_gqa=True)
            out[starts[i]:starts[i + 1]] = o.transpose(0, 1).to(out.dtype)
        return out
