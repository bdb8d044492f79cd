"""Helpers shared by Phase 04's graded suites: paged batches, the dense
oracle they are checked against, and transformers' greedy tokens.

(Imported by name from the suites: this folder is on sys.path because pytest
puts the folder of ``conftest.py`` there.)

A paged batch is built the way the model runner sees a step: each request's
cached context is already in the KV cache, at random (shuffled,
non-contiguous) block ids, every slot that holds no token is NaN (a read of
a slot that should not be read shows up as NaN), and the step's new keys and
values are handed to ``forward`` to store. The oracle is computed from the
same keys and values kept *unpaged*, in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mini_vllm.attention.backend import AttentionMetadata, get_kv_cache_shape


@dataclass
class PagedBatch:
    query: torch.Tensor  # [n, H, D] the step's new tokens
    key: torch.Tensor  # [n, H_kv, D]
    value: torch.Tensor
    kv_cache: torch.Tensor  # context stored, other slots NaN
    md: AttentionMetadata
    dense_k: list  # per request: [seq_len, H_kv, D], context then new tokens
    dense_v: list
    layout: list  # [(context_len, q_len), ...]


def make_batch(
    layout,
    num_heads,
    num_kv_heads,
    head_size,
    block_size,
    dtype=torch.float32,
    seed=0,
    device="cpu",
) -> PagedBatch:
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-(ctx + q) // block_size) for ctx, q in layout]
    num_blocks = 1 + sum(blocks_per_req) + 2  # null block 0 and two spares
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    cache = torch.full(
        get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size),
        float("nan"),
        dtype=dtype,
    )
    table = torch.zeros(len(layout), max(blocks_per_req), dtype=torch.int32)
    slots, qsl, seq_lens, dense_k, dense_v, new_k, new_v = [], [0], [], [], [], [], []
    for i, (ctx, q_len) in enumerate(layout):
        ids = torch.tensor([free.pop() for _ in range(blocks_per_req[i])], dtype=torch.int32)
        table[i, : len(ids)] = ids
        pos = torch.arange(ctx + q_len)
        block, off = ids[pos // block_size].long(), pos % block_size
        k = torch.randn(ctx + q_len, num_kv_heads, head_size, generator=gen).to(dtype)
        v = torch.randn(ctx + q_len, num_kv_heads, head_size, generator=gen).to(dtype)
        cache[block[:ctx], 0, off[:ctx]] = k[:ctx]
        cache[block[:ctx], 1, off[:ctx]] = v[:ctx]
        dense_k.append(k), dense_v.append(v), new_k.append(k[ctx:]), new_v.append(v[ctx:])
        slots += (block[ctx:] * block_size + off[ctx:]).tolist()
        qsl.append(qsl[-1] + q_len)
        seq_lens.append(ctx + q_len)
    query = torch.randn(qsl[-1], num_heads, head_size, generator=gen).to(dtype)
    md = AttentionMetadata(
        num_actual_tokens=qsl[-1],
        max_query_len=max(q for _, q in layout),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        max_seq_len=max(seq_lens),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
    )
    return PagedBatch(
        query.to(device),
        torch.cat(new_k).to(device),
        torch.cat(new_v).to(device),
        cache.to(device),
        md,
        dense_k,
        dense_v,
        list(layout),
    )


def dense_attention(batch: PagedBatch, scale: float) -> torch.Tensor:
    """The oracle: each request's queries attend causally over its unpaged
    keys and values, query head h using KV head h // group, in float64."""
    num_heads = batch.query.shape[1]
    outs = []
    start = 0
    for (ctx, q_len), k, v in zip(batch.layout, batch.dense_k, batch.dense_v, strict=True):
        q = batch.query[start : start + q_len].double().cpu()
        start += q_len
        kv_head = torch.arange(num_heads) // (num_heads // k.shape[1])
        k, v = k.double()[:, kv_head], v.double()[:, kv_head]  # [seq_len, H, D]
        s = torch.einsum("thd,nhd->htn", q, k) * scale
        visible = torch.arange(ctx + q_len)[None, :] <= (ctx + torch.arange(q_len))[:, None]
        p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
        outs.append(torch.einsum("htn,nhd->thd", p, v))
    return torch.cat(outs)
