"""Reference paged attention in plain torch: the definition the kernels must meet.

Plays the role of upstream's attention backends (for example
``vllm/v1/attention/backends/triton_attn.py``) with none of their speed:
it gathers each request's keys and values out of the paged cache and runs
ordinary causal attention, one request at a time, in float32. Left out:
everything that makes a backend fast.
"""

from __future__ import annotations

import torch

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

        # 2. Attend, request by request.
        out = torch.zeros_like(query)
        group = self.num_heads // self.num_kv_heads
        starts = attn_metadata.query_start_loc.tolist()
        seq_lens = attn_metadata.seq_lens.tolist()
        for i, seq_len in enumerate(seq_lens):
            q = query[starts[i]:starts[i + 1]].float()  # [q_len, H, D]
            q_len = q.shape[0]
            num_blocks = -(-seq_len // block_size)
            table = attn_metadata.block_table[i, :num_blocks].long()
            k = kv_cache[table, 0].reshape(-1, self.num_kv_heads, self.head_size)[:seq_len]
            v = kv_cache[table, 1].reshape(-1, self.num_kv_heads, self.head_size)[:seq_len]
            # GQA: query head h reads KV head h // group.
            k = k.float().repeat_interleave(group, dim=1)
            v = v.float().repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) * self.scale
            # New tokens sit at the end of the sequence: positions seq_len-q_len..seq_len-1.
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            k_pos = torch.arange(seq_len, device=q.device)
            scores.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[starts[i]:starts[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
        return out
