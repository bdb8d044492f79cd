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

- decode rows (one new token each): sorted by length and cut into groups of
  ``DECODE_GROUP_ROWS``; per layer, each group is one gather of its rows'
  blocks through the block table (padded to the group's longest row, into a
  reused buffer) and one SDPA call; key positions past a row's length are
  masked. Upstream's C++ decode kernel walks each row's own blocks and pads
  nothing; a batched gather must pad, and grouping by length bounds the
  padding (both the gather and SDPA grow with the padded length). GQA without
  copies: the query ``[b, num_heads, D]`` is viewed as ``[b, num_kv_heads,
  group, D]``, the group's heads taking the place of query positions, so
  every head meets its own KV head.
- prefill rows: one SDPA call per row over its gathered keys and values,
  with SDPA's own GQA (``enable_gqa``) instead of ``repeat_interleave``.

What depends only on the step's metadata (the decode/prefill split, the
groups, their block ids and masks, each prefill row's causal mask) is built
once per step by the first layer (``plan_for``) and reused by the others, as
upstream's metadata builder runs once per step for every layer.

Differs from upstream: torch operations instead of a C++ kernel with its ISA
variants; upstream hands its SDPA prefill the step's new keys and values
(cpu_attn.py:369 reads ``key[num_decode_tokens:num_actual_tokens]``),
mini_vllm gathers each prefill row's keys and values through the block
table, cached prefix included, as the torch backend does. Left out: FP8 KV
cache, ALiBi, soft-capping, sinks, encoder attention; see
UPSTREAM_PIN.md.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mini_vllm.attention.backend import AttentionImpl, AttentionMetadata
from mini_vllm.attention.backends.torch_attn import reshape_and_cache
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


# Decode rows per padded group: rows are sorted by length and cut into groups of
# this many, each padded to its own longest row (see the module docstring).
DECODE_GROUP_ROWS = 32


@dataclass
class DecodeGroup:
    """Decode rows of similar length, gathered and attended together."""

    tokens: torch.Tensor  # int64 [b]: each row's only query token
    blocks: torch.Tensor  # int64 [b * num_blocks]: the rows' block ids, row after row
    # bool [b, 1, 1, num_blocks * block_size]: key positions < seq_len (and in the window)
    valid: torch.Tensor


@dataclass
class PrefillRow:
    """A row with several new tokens: its query tokens, blocks and causal mask."""

    start: int
    end: int
    seq_len: int
    blocks: torch.Tensor  # int64 [cdiv(seq_len, block_size)]
    mask: torch.Tensor  # bool [q_len, seq_len]


@dataclass
class CPUAttentionPlan:
    """What every layer of one step needs from the metadata, computed once per step
    (upstream's ``CPUAttentionMetadataBuilder.build``,
    vllm/v1/attention/backends/cpu_attn.py:171, likewise runs once per step and
    splits decodes from prefills for all layers)."""

    decode_groups: list[DecodeGroup]
    prefill_rows: list[PrefillRow]


def build_plan(
    attn_metadata: AttentionMetadata, block_size: int, sliding_window: int | None = None
) -> CPUAttentionPlan:
    """``sliding_window``: a query at position p sees positions p-w+1..p only."""
    w = sliding_window
    starts = attn_metadata.query_start_loc  # [num_reqs + 1]
    seq_lens = attn_metadata.seq_lens  # [num_reqs]
    q_lens = starts[1:] - starts[:-1]  # [num_reqs]
    is_decode = q_lens == 1  # [num_reqs]
    # Decode rows, shortest first, in groups: each pads only to its own longest row.
    decode_rows = is_decode.nonzero().flatten()  # [B]
    decode_rows = decode_rows[seq_lens[decode_rows].argsort(stable=True)]
    groups = []
    for rows in decode_rows.split(DECODE_GROUP_ROWS) if decode_rows.numel() else ():
        lens = seq_lens[rows]  # [b]
        num_blocks = cdiv(int(lens.max()), block_size)
        table = attn_metadata.block_table[rows, :num_blocks]  # [b, num_blocks]
        positions = torch.arange(num_blocks * block_size, device=lens.device)
        valid = positions < lens[:, None]  # [b, L]; the query sits at lens - 1
        if w is not None:
            valid &= positions > lens[:, None] - 1 - w
        groups.append(
            DecodeGroup(
                tokens=starts[rows].long(),
                blocks=table.flatten().long(),
                valid=valid[:, None, None, :],
            )
        )
    prefill = []
    starts_list, seq_lens_list = starts.tolist(), seq_lens.tolist()
    for i in (~is_decode).nonzero().flatten().tolist():
        start, end, seq_len = starts_list[i], starts_list[i + 1], seq_lens_list[i]
        key_pos = torch.arange(seq_len, device=seq_lens.device)  # [seq_len]
        q_pos = key_pos[seq_len - (end - start) :]  # [q_len]
        table = attn_metadata.block_table[i, : cdiv(seq_len, block_size)]
        mask = key_pos[None, :] <= q_pos[:, None]  # [q_len, seq_len]
        if w is not None:
            mask &= key_pos[None, :] > q_pos[:, None] - w
        prefill.append(PrefillRow(start, end, seq_len, table.long(), mask))
    return CPUAttentionPlan(groups, prefill)


def plan_for(
    attn_metadata: AttentionMetadata, block_size: int, sliding_window: int | None = None
) -> CPUAttentionPlan:
    """The step's plan, built by the first layer that sees this metadata (and window)
    and reused by the others (the runner builds new metadata every step; a hybrid
    model's layers alternate between a few, one per KV-cache group)."""
    plans = getattr(_workspace, "plans", None)
    if plans is None:
        plans = _workspace.plans = {}
    key = (id(attn_metadata), block_size, sliding_window)
    cached = plans.get(key)
    if cached is None or cached[0] is not attn_metadata:
        if len(plans) >= 8:  # older steps' plans: drop them
            plans.clear()
        cached = plans[key] = (
            attn_metadata,
            build_plan(attn_metadata, block_size, sliding_window),
        )
    return cached[1]


class CPUAttentionBackendImpl(AttentionImpl):
    # Decodes first on every CPU (upstream: only off x86 and ARM, see above).
    reorder_batch_threshold = 1

    def forward(
        self, query, key, value, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        n = attn_metadata.num_actual_tokens
        reshape_and_cache(key[:n], value[:n], kv_cache, attn_metadata.slot_mapping[:n])

        out = torch.zeros_like(query)  # [num_tokens, num_heads, head_size]
        plan = plan_for(attn_metadata, kv_cache.shape[2], self.sliding_window)
        for group in plan.decode_groups:
            self._decode(query, kv_cache, group, out)
        for row in plan.prefill_rows:
            self._prefill(query, kv_cache, row, out)
        return out

    def _decode(self, query, kv_cache, group: DecodeGroup, out) -> None:
        """A group of one-token rows at once: a padded gather and one batched SDPA."""
        b, kv_heads = group.tokens.numel(), self.num_kv_heads
        # The group's blocks, keys then values: [2, b * num_blocks, block_size, kv_heads, D].
        kv = gather_workspace((2, group.blocks.numel(), *kv_cache.shape[2:]), kv_cache)
        torch.index_select(kv_cache[:, 0], 0, group.blocks, out=kv[0])
        torch.index_select(kv_cache[:, 1], 0, group.blocks, out=kv[1])
        # [b, kv_heads, L, D] views, L = num_blocks * block_size (padded length)
        k, v = (x.view(b, -1, kv_heads, self.head_size).transpose(1, 2).float() for x in kv)
        # A row's query heads h = kv * group + g all read KV head kv: [b, kv_heads, group, D].
        q = query[group.tokens].float().view(b, kv_heads, -1, self.head_size)
        # Key positions past the row's length (other requests' stale slots or the null
        # block) are masked out by group.valid.
        o = F.scaled_dot_product_attention(  # [b, kv_heads, group, D]
            q, k, v, attn_mask=group.valid, scale=self.scale
        )
        out[group.tokens] = o.reshape(b, self.num_heads, self.head_size).to(out.dtype)

    def _prefill(self, query, kv_cache, row: PrefillRow, out) -> None:
        """One causal SDPA over the row's cached and new keys."""
        q = query[row.start : row.end].float().transpose(0, 1)  # [H, q_len, D]
        # [2, kv_heads, seq_len, D]
        kv = kv_cache[row.blocks].permute(1, 3, 0, 2, 4).flatten(2, 3)[:, :, : row.seq_len]
        o = F.scaled_dot_product_attention(  # [H, q_len, D]
            q,
            kv[0].float(),
            kv[1].float(),
            attn_mask=row.mask,
            scale=self.scale,
            enable_gqa=True,
        )
        out[row.start : row.end] = o.transpose(0, 1).to(out.dtype)
