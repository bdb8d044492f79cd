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
  keys and values, token by token through the block table (padded to the
  group's longest row, into a reused buffer), and one SDPA call; key
  positions past a row's length are masked. Upstream's C++ decode kernel
  walks each row's own blocks in place and pads nothing; a batched gather
  must copy and pad, and grouping by length bounds the padding (both the
  gather and SDPA grow with the padded length). GQA without copies: the
  query ``[b, num_heads, D]`` is viewed as ``[b, num_kv_heads, group, D]``,
  the group's heads taking the place of query positions, so every head meets
  its own KV head.
- prefill rows (several new tokens each): sorted by length and cut into
  groups of at most ``PREFILL_GROUP_CELLS`` padded query x key cells; per
  layer, each group is one gather and one SDPA call, queries padded to the
  group's longest row (a padded slot repeats its row's last token, and its
  output is dropped) and keys masked causally from each query's own position,
  with SDPA's own GQA (``enable_gqa``) instead of ``repeat_interleave``.
  Upstream calls SDPA once per prefill row (``_run_sdpa_forward``
  :400, its loop at :436); a call has a fixed cost that short prompts
  do not amortise, so mini_vllm pads a few together.
- the store and the gathers address the cache the same way: as rows of
  ``[num_kv_heads, head_size]``, one row a token, where the key at offset o
  of block n is row ``n * 2 * block_size + o`` and its value ``block_size``
  rows further on (``cache_rows``). The store is two row copies
  (``index_copy_``, ``store_kv``), as upstream's backend has its own store op
  (its ``forward`` :292 calls ops.cpu_attn_reshape_and_cache); a gather is
  two row selections (``index_select``, ``gather_kv``) from a contiguous
  source.

What depends only on the step's metadata (the decode/prefill split, the
groups, their cache rows and masks, the store's rows) is built
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
    key_rows: torch.Tensor  # int64 [b * L]: each row's keys 0..L-1 (cache_rows), row after row
    # float [b, 1, 1, L]: 0 at key positions < seq_len (and in the window), -inf past them;
    # SDPA adds it to the scores (a bool mask it would convert on every layer)
    mask: torch.Tensor


# Prefill rows per padded group: rows are sorted by length and a group takes them
# while its padded query x key rectangles stay within this many cells (the math SDPA
# holds a score for each, per head); a row larger than that is a group alone.
PREFILL_GROUP_CELLS = 2**15


@dataclass
class PrefillGroup:
    """Rows with several new tokens each, padded to the group's longest query and keys."""

    queries: torch.Tensor  # int64 [b * q]: each padded query slot's token (a row's last repeats)
    key_rows: torch.Tensor  # int64 [b * L]: each row's keys 0..L-1 (cache_rows), row after row
    # float [b, 1, q, L]: 0 where a query slot sees the key (causal, window), -inf elsewhere
    mask: torch.Tensor
    real: torch.Tensor  # int64 [n]: the padded slots that are real tokens, in order
    tokens: torch.Tensor  # int64 [n]: those tokens (where their outputs go)


@dataclass
class CPUAttentionPlan:
    """What every layer of one step needs from the metadata, computed once per step
    (upstream's ``CPUAttentionMetadataBuilder.build``,
    vllm/v1/attention/backends/cpu_attn.py:171, likewise runs once per step and
    splits decodes from prefills for all layers)."""

    decode_groups: list[DecodeGroup]
    prefill_groups: list[PrefillGroup]
    # int64 [n]: the cache row of token t's key (its value: block_size rows further on)
    key_rows: torch.Tensor


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
        positions = torch.arange(int(lens.max()), device=lens.device)  # [L]
        valid = positions < lens[:, None]  # [b, L]; the query sits at lens - 1
        if w is not None:
            valid &= positions > lens[:, None] - 1 - w
        table = attn_metadata.block_table[rows]  # [b, max_blocks]
        groups.append(
            DecodeGroup(
                tokens=starts[rows].long(),
                key_rows=cache_rows(table, positions, block_size).flatten(),
                mask=additive_mask(valid[:, None, None, :]),
            )
        )
    # Prefill rows, shortest first, in groups of at most PREFILL_GROUP_CELLS padded cells.
    prefill_rows = (~is_decode).nonzero().flatten()
    prefill_rows = prefill_rows[seq_lens[prefill_rows].argsort(stable=True)].tolist()
    q_list, seq_list = q_lens.tolist(), seq_lens.tolist()
    prefill, rows = [], []
    for i in prefill_rows:
        bigger = rows + [i]
        cells = len(bigger) * max(q_list[r] for r in bigger) * seq_list[i]
        if rows and cells > PREFILL_GROUP_CELLS:
            prefill.append(prefill_group(attn_metadata, rows, block_size, w))
            bigger = [i]
        rows = bigger
    if rows:
        prefill.append(prefill_group(attn_metadata, rows, block_size, w))
    # Slot s is offset s % block_size of block s // block_size.
    slots = attn_metadata.slot_mapping[: attn_metadata.num_actual_tokens]
    key_rows = slots // block_size * (2 * block_size) + slots % block_size
    return CPUAttentionPlan(groups, prefill, key_rows)


def cache_rows(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """int64 [b, L]: the cache rows of the keys at ``positions`` [L] of each row of the
    block ``table`` [b, max_blocks], the cache seen as rows of [num_kv_heads, head_size]
    (``kv_cache.view(-1, num_kv_heads, head_size)``): block n's keys are rows
    n * 2 * block_size onwards, its values the block_size rows after them."""
    blocks = table[:, positions // block_size].long()  # [b, L]
    return blocks * (2 * block_size) + positions % block_size


def additive_mask(visible: torch.Tensor) -> torch.Tensor:
    """float32 0 where ``visible``, -inf elsewhere: what SDPA makes of a bool mask."""
    return torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))


def prefill_group(
    attn_metadata: AttentionMetadata, rows: list[int], block_size: int, w: int | None
) -> PrefillGroup:
    """The padded group of prefill ``rows`` (request indices): row i's query slot j is
    its token min(j, q_len - 1), at position seq_len - q_len + that, and sees the key
    positions up to its own (a padded slot repeats the row's last token, so no mask
    row is empty)."""
    rows_t = torch.tensor(rows)
    starts = attn_metadata.query_start_loc[rows_t].long()  # [b]
    q_lens = attn_metadata.query_start_loc[rows_t + 1].long() - starts  # [b]
    seq_lens = attn_metadata.seq_lens[rows_t].long()  # [b]
    slot = torch.arange(int(q_lens.max()))  # [q]
    j = torch.minimum(slot[None, :], q_lens[:, None] - 1)  # [b, q]: the token within its row
    q_pos = (seq_lens - q_lens)[:, None] + j  # [b, q]
    key_pos = torch.arange(int(seq_lens.max()))  # [L]
    mask = key_pos <= q_pos[:, :, None]  # [b, q, L]
    if w is not None:
        mask &= key_pos > q_pos[:, :, None] - w
    real = (slot[None, :] < q_lens[:, None]).flatten().nonzero().flatten()  # [n]
    queries = (starts[:, None] + j).flatten()  # [b * q]
    key_rows = cache_rows(attn_metadata.block_table[rows_t], key_pos, block_size)  # [b, L]
    mask = additive_mask(mask[:, None])  # [b, 1, q, L]
    return PrefillGroup(queries, key_rows.flatten(), mask, real, queries[real])


def store_kv(key, value, kv_cache: torch.Tensor, key_rows: torch.Tensor, block_size: int):
    """The step's keys and values into the cache at their slots: what
    ``reshape_and_cache`` (torch_attn.py) does, as two row copies (``index_copy_``)
    at rows the plan computed once for every layer, where indexing by (block, 0,
    offset) costs more per layer. Upstream's CPU backend has its own store too: its
    ``forward`` (vllm/v1/attention/backends/cpu_attn.py:292) calls
    ops.cpu_attn_reshape_and_cache."""
    rows = kv_cache.view(-1, *kv_cache.shape[3:])  # [num_blocks * 2 * block_size, kv_heads, D]
    key, value = key.to(kv_cache.dtype), value.to(kv_cache.dtype)
    if kv_cache.element_size() == 1:  # index_copy_ has no float8 kernel: copy the bytes
        rows, key, value = rows.view(torch.uint8), key.view(torch.uint8), value.view(torch.uint8)
    rows.index_copy_(0, key_rows, key)
    rows.index_copy_(0, key_rows + block_size, value)


def gather_kv(kv_cache: torch.Tensor, key_rows: torch.Tensor) -> torch.Tensor:
    """The keys and values at ``key_rows`` (``cache_rows``), copied into the reused
    workspace: [2, n, kv_heads, D]. Selecting rows of the whole cache reads a
    contiguous source, which ``index_select`` copies row by row."""
    rows = kv_cache.view(-1, *kv_cache.shape[3:])  # [num_blocks * 2 * block_size, kv_heads, D]
    kv = gather_workspace((2, key_rows.numel(), *rows.shape[1:]), kv_cache)
    torch.index_select(rows, 0, key_rows, out=kv[0])
    torch.index_select(rows, 0, key_rows + kv_cache.shape[2], out=kv[1])
    return kv


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
        plan = plan_for(attn_metadata, kv_cache.shape[2], self.sliding_window)
        store_kv(key[:n], value[:n], kv_cache, plan.key_rows, kv_cache.shape[2])

        # [num_tokens, num_heads, head_size]: each of the n tokens belongs to one decode
        # or prefill row, which writes it below; padding tokens after them read 0.
        out = torch.empty_like(query)
        out[n:].zero_()
        for group in plan.decode_groups:
            self._decode(query, kv_cache, group, out)
        for group in plan.prefill_groups:
            self._prefill(query, kv_cache, group, out)
        return out

    def _decode(self, query, kv_cache, group: DecodeGroup, out) -> None:
        """A group of one-token rows at once: a padded gather and one batched SDPA."""
        b, kv_heads = group.tokens.numel(), self.num_kv_heads
        kv = gather_kv(kv_cache, group.key_rows)  # [2, b * L, kv_heads, D]
        # [b, kv_heads, L, D] views, L = the group's longest row (padded length)
        k, v = (x.view(b, -1, kv_heads, self.head_size).transpose(1, 2).float() for x in kv)
        # A row's query heads h = kv * group + g all read KV head kv: [b, kv_heads, group, D].
        q = query[group.tokens].float().view(b, kv_heads, -1, self.head_size)
        # Key positions past the row's length (other requests' stale slots or the null
        # block) are masked out by group.mask.
        o = F.scaled_dot_product_attention(  # [b, kv_heads, group, D]
            q, k, v, attn_mask=group.mask, scale=self.scale
        )
        out.index_copy_(0, group.tokens, o.reshape(b, self.num_heads, self.head_size).to(out.dtype))

    def _prefill(self, query, kv_cache, group: PrefillGroup, out) -> None:
        """A group of prefill rows at once: a padded gather and one causal SDPA over
        each row's cached and new keys."""
        b, heads, kv_heads, d = (
            group.mask.shape[0],
            self.num_heads,
            self.num_kv_heads,
            self.head_size,
        )
        kv = gather_kv(kv_cache, group.key_rows)  # [2, b * L, kv_heads, D]
        # [b, kv_heads, L, D] views, L = the group's longest row (padded length)
        k, v = (x.view(b, -1, kv_heads, d).transpose(1, 2).float() for x in kv)
        q = query[group.queries].float().view(b, -1, heads, d).transpose(1, 2)  # [b, H, q, D]
        o = F.scaled_dot_product_attention(  # [b, H, q, D]
            q, k, v, attn_mask=group.mask, scale=self.scale, enable_gqa=True
        )
        o = o.transpose(1, 2).reshape(-1, heads, d)[group.real]  # [n, H, D]: real slots only
        out.index_copy_(0, group.tokens, o.to(out.dtype))
