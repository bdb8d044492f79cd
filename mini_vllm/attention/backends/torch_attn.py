"""Reference paged attention in plain torch: the definition the kernels must meet.

Plays the role of upstream's attention backends (for example
``TritonAttentionImpl.forward`` (vllm/v1/attention/backends/triton_attn.py:526))
with none of their speed: it stores the new keys and values at their slots
(``reshape_and_cache``, which the cpu backend shares; upstream:
``do_kv_cache_update`` (triton_attn.py:720) calling
``triton_reshape_and_cache_flash``), then gathers each request's keys and
values out of the paged cache through its block table and runs ordinary
causal attention (torch's ``scaled_dot_product_attention``), one request at a
time, in float32; a sliding-window layer also masks keys older than its
window. Left out: everything that makes a backend fast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mini_vllm.attention.backend import AttentionImpl, AttentionMetadata
from mini_vllm.kv_cache_interface import cdiv


def reshape_and_cache(
    key: torch.Tensor,  # [n, num_kv_heads, head_size]
    value: torch.Tensor,  # [n, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [n]
) -> None:
    """Write ``key[t]`` and ``value[t]`` into ``kv_cache`` at slot ``slot_mapping[t]``,
    in place, converted to the cache's dtype: the torch twin of the Triton kernel in
    ops/triton_reshape_and_cache.py, shared by the torch and cpu backends."""
    # BEGIN LAB 04.2: reshape_and_cache (the store), in torch
    # HINT: receives key, value, kv_cache, slot_mapping; leaves the n new keys and values
    # HINT: written into kv_cache (nothing else).
    # HINT: slot s is offset s % block_size of block s // block_size;
    # HINT: kv_cache[block, 0, offset] holds a key, kv_cache[block, 1, offset] its value.
    block_size = kv_cache.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size  # [n] each
    # kv_cache[blocks, 0, offsets]: [n, num_kv_heads, head_size], as key
    kv_cache[blocks, 0, offsets] = key.to(kv_cache.dtype)
    kv_cache[blocks, 1, offsets] = value.to(kv_cache.dtype)
    # END LAB 04.2


class TorchAttentionImpl(AttentionImpl):
    # Decodes first on every CPU, so the reorder runs; upstream's CPU backend
    # asks for it only off x86 and ARM (vllm/v1/attention/backends/cpu_attn.py:139).
    reorder_batch_threshold = 1

    def forward(
        self, query, key, value, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        n = attn_metadata.num_actual_tokens
        block_size = kv_cache.shape[2]
        # 1. Store the new keys and values in their slots.
        reshape_and_cache(key[:n], value[:n], kv_cache, attn_metadata.slot_mapping[:n])

        # 2. Attend, request by request: the query rows are the last q_len
        #    positions of a sequence of seq_len tokens, so row r (position
        #    seq_len - q_len + r) may see key positions 0 .. seq_len - q_len + r.
        out = torch.zeros_like(query)  # [num_tokens, num_heads, head_size]
        starts = attn_metadata.query_start_loc.tolist()  # num_reqs + 1 ints
        seq_lens = attn_metadata.seq_lens.tolist()
        group = self.num_heads // self.num_kv_heads
        for i, seq_len in enumerate(seq_lens):
            q = query[starts[i] : starts[i + 1]].float().transpose(0, 1)  # [H, q_len, D]
            q_len = q.shape[1]
            # BEGIN LAB 04.2: gather this request's keys and values, and its causal mask
            # HINT: receives i, q, q_len, seq_len, group, block_size, kv_cache; leaves k, v and
            # HINT: mask defined (scaled_dot_product_attention after the region reads them).
            # HINT: k, v: [seq_len, num_heads, head_size], key position j of this
            # HINT: request = offset j % block_size of block block_table[i, j // block_size].
            # HINT: GQA: query head h reads KV head h // group (repeat_interleave, not repeat).
            # HINT: mask: [q_len, seq_len] bool, True where key position <= query position.
            num_blocks = cdiv(seq_len, block_size)
            table = attn_metadata.block_table[i, :num_blocks].long()  # [num_blocks]
            # [seq_len, num_kv_heads, head_size]
            k = kv_cache[table, 0].reshape(-1, self.num_kv_heads, self.head_size)[:seq_len]
            v = kv_cache[table, 1].reshape(-1, self.num_kv_heads, self.head_size)[:seq_len]
            k = k.repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_size]
            v = v.repeat_interleave(group, dim=1)
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)  # [q_len]
            # [q_len, seq_len]: True where the key position is at or before the query's
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
            # END LAB 04.2
            if self.sliding_window is not None:
                # Only the last sliding_window positions, the query's own included.
                key_pos = torch.arange(seq_len, device=q.device)  # [seq_len]
                query_pos = key_pos[seq_len - q_len :]  # [q_len]
                mask = mask & (key_pos[None, :] > query_pos[:, None] - self.sliding_window)
            o = F.scaled_dot_product_attention(  # [num_heads, q_len, head_size]
                q,
                k.float().transpose(0, 1),
                v.float().transpose(0, 1),
                attn_mask=mask,
                scale=self.scale,
            )
            out[starts[i] : starts[i + 1]] = o.transpose(0, 1).to(out.dtype)
        return out
