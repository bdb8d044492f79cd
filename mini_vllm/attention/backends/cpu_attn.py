"""Paged attention on a CPU, batched: the engine's default backend there.

Mirrors upstream ``vllm/v1/attention/backends/cpu_attn.py``
(``CPUAttentionBackendImpl`` :238, whose ``forward`` :292 sends decodes to a
C++ kernel and prefills to ``_run_sdpa_forward`` :400) at v0.22.1, in its
role: upstream's CPU platform selects no other backend
(``get_attn_backend_cls`` (vllm/platforms/cpu.py:74) returns CPU_ATTN). Its
metadata builder asks for decodes first only on architectures that do not
prefer mixed batches (``CPUAttentionMetadataBuilder.__init__``
(vllm/v1/attention/backends/cpu_attn.py:128) tests the list at :139; x86 and
ARM are in it); mini_vllm asks for it on every CPU, so the reorder runs, and
finds its one-token rows wherever they are.

It computes what ``TorchAttentionImpl`` (torch_attn.py, the readable
definition) computes, to float32 rounding, in fewer and larger operations:

- decode rows (one new token each): one gather of every decode row's
  blocks through the block table (padded to the longest row, into a reused
  buffer) and one SDPA call over all of them per layer; key positions past a
  row's length are masked. GQA without copies: the query ``[B, num_heads,
  D]`` is viewed as ``[B, num_kv_heads, group, D]``, the group's heads taking
  the place of query positions, so every head meets its own KV head.
- prefill rows: one SDPA call per row over its gathered keys and values,
  with SDPA's own GQA (``enable_gqa``) instead of ``repeat_interleave``.

Differs from upstream: torch operations instead of a C++ kernel with its ISA
variants; upstream hands its SDPA prefill the step's new keys and values
(cpu_attn.py:369 reads ``key[num_decode_tokens:num_actual_tokens]``),
mini_vllm gathers each prefill row's keys and values through the block
table, cached prefix included, as the torch backend does. Left out: FP8 KV
cache, sliding windows, ALiBi, soft-capping, sinks, encoder attention; see
UPSTREAM_PIN.md.
"""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F

from mini_vllm.attention.backend import AttentionImpl, AttentionMetadata
from mini_vllm.kv_cache_interface import cdiv

_workspace = threading.local()


def gather_workspace(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of ``shape`` in a buffer this thread reuses for every layer
    and step, grown when a step needs more (upstream keeps one workspace the same way,
    ``WorkspaceManager``, vllm/v1/worker/workspace.py:31). A fresh tensor of tens of MB
    per layer would cost more in page faults than the gather into it."""
    need = math.prod(shape)
    buf = getattr(_workspace, "buf", None)
    if (
        buf is None
        or buf.numel() < need
        or (buf.dtype, buf.device) != (like.dtype, like.device)
        # One made under inference_mode (the runner's) cannot be written outside it.
        or buf.is_inference() != torch.is_inference_mode_enabled()
    ):
        buf = _workspace.buf = torch.empty(need, dtype=like.dtype, device=like.device)
    return buf[:need].view(shape)


class CPUAttentionBackendImpl(AttentionImpl):
    # Decodes first on every CPU (upstream: only off x86 and ARM, see above).
    reorder_batch_threshold = 1

    def forward(
        self, query, key, value, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        n = attn_metadata.num_actual_tokens
        block_size = kv_cache.shape[2]
        slot_mapping = attn_metadata.slot_mapping[:n]  # [n]
        blocks, offsets = slot_mapping // block_size, slot_mapping % block_size  # [n] each
        kv_cache[blocks, 0, offsets] = key[:n].to(kv_cache.dtype)
        kv_cache[blocks, 1, offsets] = value[:n].to(kv_cache.dtype)

        out = torch.zeros_like(query)  # [num_tokens, num_heads, head_size]
        starts = attn_metadata.query_start_loc  # [num_reqs + 1]
        q_lens = starts[1:] - starts[:-1]  # [num_reqs]
        is_decode = q_lens == 1  # [num_reqs]
        decode_rows = is_decode.nonzero().flatten()  # [B]
        if decode_rows.numel():
            self._decode(query, kv_cache, attn_metadata, decode_rows, out)
        if decode_rows.numel() < q_lens.numel():
            self._prefill(query, kv_cache, attn_metadata, (~is_decode).nonzero().flatten(), out)
        return out

    def _decode(self, query, kv_cache, attn_metadata, rows, out) -> None:
        """All one-token rows at once: a padded gather and one batched SDPA."""
        block_size = kv_cache.shape[2]
        tokens = attn_metadata.query_start_loc[rows]  # [B]: each row's only query token
        seq_lens = attn_metadata.seq_lens[rows]  # [B]
        num_blocks = cdiv(int(seq_lens.max()), block_size)
        table = attn_metadata.block_table[rows, :num_blocks].long()  # [B, num_blocks]
        b, kv_heads, group = rows.numel(), self.num_kv_heads, self.num_heads // self.num_kv_heads
        # Every row's blocks, keys then values: [2, B * num_blocks, block_size, kv_heads, D].
        kv = gather_workspace((2, table.numel(), *kv_cache.shape[2:]), kv_cache)
        torch.index_select(kv_cache[:, 0], 0, table.flatten(), out=kv[0])
        torch.index_select(kv_cache[:, 1], 0, table.flatten(), out=kv[1])
        # [B, kv_heads, L, D] views, L = num_blocks * block_size (padded length)
        k, v = (x.view(b, -1, kv_heads, self.head_size).transpose(1, 2).float() for x in kv)
        # A row's query heads h = kv * group + g all read KV head kv: [B, kv_heads, group, D].
        q = query[tokens].float().view(b, kv_heads, group, self.head_size)
        # Key positions before the row's length are real; the rest is padding (other
        # requests' stale slots or the null block), masked out. [B, 1, 1, L]
        valid = torch.arange(k.shape[2], device=k.device) < seq_lens[:, None]
        o = F.scaled_dot_product_attention(  # [B, kv_heads, group, D]
            q, k, v, attn_mask=valid[:, None, None, :], scale=self.scale
        )
        out[tokens] = o.reshape(b, self.num_heads, self.head_size).to(out.dtype)

    def _prefill(self, query, kv_cache, attn_metadata, rows, out) -> None:
        """Rows with several new tokens: one causal SDPA each over the cached and new keys."""
        block_size = kv_cache.shape[2]
        starts = attn_metadata.query_start_loc.tolist()
        seq_lens = attn_metadata.seq_lens.tolist()
        for i in rows.tolist():
            seq_len, q = seq_lens[i], query[starts[i] : starts[i + 1]]
            q = q.float().transpose(0, 1)  # [H, q_len, D]
            q_len = q.shape[1]
            table = attn_metadata.block_table[i, : cdiv(seq_len, block_size)].long()
            # [2, kv_heads, seq_len, D]
            kv = kv_cache[table].permute(1, 3, 0, 2, 4).flatten(2, 3)[:, :, :seq_len]
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)  # [q_len]
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(  # [H, q_len, D]
                q,
                kv[0].float(),
                kv[1].float(),
                attn_mask=mask,
                scale=self.scale,
                enable_gqa=True,
            )
            out[starts[i] : starts[i + 1]] = o.transpose(0, 1).to(out.dtype)
