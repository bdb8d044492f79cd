"""Paged attention for one query token per request, split over the KV (Triton).

Mirrors upstream ``vllm/v1/attention/ops/triton_decode_attention.py``
(``_fwd_grouped_kernel_stage1`` :262 and ``_fwd_kernel_stage2`` :549, launched
by ``decode_attention_fwd`` :729) at v0.22.1; upstream's unified kernel does
the same split in its "3D" mode (``reduce_segments``
(triton_unified_attention.py:646)). Left out: logit soft-capping,
the separate value head size of MLA, FP8 scales, sinks, and the tuning.

Why split: a decode step has one query per request, so a grid of (request,
KV head) programs is small while each walks the whole context alone. Stage 1
gives each request ``num_splits`` programs per KV head, each over a
contiguous range of the context, producing partial softmax results; stage 2
merges them with the same rescaling the online softmax uses.

Invariants:
- every request has exactly one query token, at row ``query_start_loc[i]``;
  it sits at position ``seq_len - 1`` and sees keys ``0 .. seq_len - 1``
  (``seq_len - w .. seq_len - 1`` with a sliding window of w);
- a split writes (max m, sum-exp l, unnormalised acc); an empty split writes
  m = -inf, l = 0, acc = 0, which the merge weighs as zero;
- all arithmetic is float32 (the dot products are done as broadcast-and-sum,
  which also keeps bfloat16 correct under Triton's interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_split_kernel(
    q_ptr,
    kv_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    part_acc_ptr,  # float32 [num_reqs, num_heads, num_splits, head_size]
    part_max_ptr,  # float32 [num_reqs, num_heads, num_splits]
    part_sum_ptr,  # float32 [num_reqs, num_heads, num_splits]
    scale,
    num_heads,
    num_splits,
    q_stride_tok,
    q_stride_head,
    cache_stride_block,
    cache_stride_kv,
    cache_stride_slot,
    cache_stride_head,
    block_table_stride,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr = 0,  # 0: full attention; w: the last w positions only
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    tok = tl.load(query_start_loc_ptr + req).to(tl.int64)

    # This split's keys: [kv_lo, kv_hi). The context is cut into num_splits
    # ranges of whole TILE_N tiles; the last ranges may be short or empty.
    span = tl.cdiv(tl.cdiv(seq_len, num_splits), TILE_N) * TILE_N
    kv_lo = split * span
    kv_hi = tl.minimum(seq_len, kv_lo + span)
    if SLIDING_WINDOW > 0:
        # The query (at seq_len - 1) sees its last SLIDING_WINDOW positions:
        # a split wholly before them is empty, one across their start is cut.
        kv_lo = tl.maximum(kv_lo, seq_len - SLIDING_WINDOW)

    # The GROUP query heads sharing this KV head form the rows of the tile.
    g = tl.arange(0, GROUP_PAD)
    head = kv_head * GROUP + g
    head_ok = g < GROUP
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_SIZE
    q = tl.load(
        q_ptr + tok * q_stride_tok + head[:, None] * q_stride_head + dims[None, :],
        mask=head_ok[:, None] & dim_ok[None, :],
        other=0.0,
    ).to(tl.float32)

    m = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l = tl.zeros([GROUP_PAD], dtype=tl.float32)  # noqa: E741 (l: the softmax sum, as in the phase 04 text)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], dtype=tl.float32)
    bt_row = block_table_ptr + req.to(tl.int64) * block_table_stride
    for start in range(kv_lo, kv_hi, TILE_N):
        k_pos = start + tl.arange(0, TILE_N)
        k_ok = k_pos < kv_hi
        block = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        kv_ptr = (
            kv_cache_ptr
            + block[:, None] * cache_stride_block
            + (k_pos % BLOCK_SIZE)[:, None] * cache_stride_slot
            + kv_head * cache_stride_head
            + dims[None, :]
        )
        kv_mask = k_ok[:, None] & dim_ok[None, :]
        k = tl.load(kv_ptr, mask=kv_mask, other=0.0).to(tl.float32)  # [TILE_N, HEAD_PAD]
        v = tl.load(kv_ptr + cache_stride_kv, mask=kv_mask, other=0.0).to(tl.float32)

        # A handful of rows is too few for tl.dot (the GPU wants >= 16), and
        # decode is bound by reading K/V anyway: multiply and sum instead.
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP_PAD, TILE_N]
        s = tl.where(k_ok[None, :], s, float("-inf"))

        # Online softmax: rescale what was summed so far by exp(m - m_new).
        # kv_lo < kv_hi here, so every tile has a real key and m_new is finite.
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)  # noqa: E741 (l: the softmax sum, as in the phase 04 text)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new

    # Partial results, unnormalised: stage 2 needs (m, l, acc) to merge.
    row = (req * num_heads + head).to(tl.int64) * num_splits + split
    tl.store(part_max_ptr + row, m, mask=head_ok)
    tl.store(part_sum_ptr + row, l, mask=head_ok)
    tl.store(
        part_acc_ptr + row[:, None] * HEAD_SIZE + dims[None, :],
        acc,
        mask=head_ok[:, None] & dim_ok[None, :],
    )


@triton.jit
def _decode_merge_kernel(
    out_ptr,
    query_start_loc_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    num_heads,
    num_splits,
    out_stride_tok,
    out_stride_head,
    SPLITS_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    # One program per (request, query head): merge its num_splits partials.
    req = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < num_splits
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_SIZE
    row = (req * num_heads + head).to(tl.int64) * num_splits + splits
    m = tl.load(part_max_ptr + row, mask=split_ok, other=float("-inf"))
    l = tl.load(part_sum_ptr + row, mask=split_ok, other=0.0)  # noqa: E741 (l: the softmax sum, as in the phase 04 text)
    acc = tl.load(
        part_acc_ptr + row[:, None] * HEAD_SIZE + dims[None, :],
        mask=split_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )

    # BEGIN LAB 04.3: the split-KV merge (stage 2) in Triton
    # HINT: receives m, l, acc (loaded above); leaves out defined (the store below reads it).
    # HINT: split s holds m_s (its max score), l_s = sum exp(score - m_s) and
    # HINT: acc_s = sum exp(score - m_s) * v over its keys. Padded or empty splits
    # HINT: hold m = -inf, l = 0, acc = 0. Shapes: m, l [SPLITS_PAD]; acc [SPLITS_PAD, HEAD_PAD].
    # HINT: produce out [HEAD_PAD] (float32) = softmax over ALL the keys, times V.
    # HINT: tl.max(x, axis=0), tl.sum(x, axis=0), tl.exp; broadcast with w[:, None].
    # Split s summed exp(score - m_s). Bring all onto the global max M:
    # multiply by w_s = exp(m_s - M) (0 for an empty split, whose m_s = -inf).
    # softmax(scores) @ V = sum_s w_s acc_s / sum_s w_s l_s.
    m_all = tl.max(m, axis=0)  # finite: split 0 always holds key 0
    w = tl.exp(m - m_all)
    out = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l, axis=0)
    # END LAB 04.3

    tok = tl.load(query_start_loc_ptr + req).to(tl.int64)
    tl.store(
        out_ptr + tok * out_stride_tok + head * out_stride_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_ok,
    )


def decode_attention(
    out: torch.Tensor,  # [num_tokens, num_heads, head_size], written in place
    query: torch.Tensor,  # [num_tokens, num_heads, head_size], one row per request
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
    block_table: torch.Tensor,  # int32 [num_reqs, max_blocks_per_req]
    seq_lens: torch.Tensor,  # int32 [num_reqs]
    query_start_loc: torch.Tensor,  # int32 [num_reqs + 1], consecutive (q_len 1)
    max_seq_len: int,
    scale: float,
    num_splits: int | None = None,
    tile_n: int = 32,
    sliding_window: int | None = None,
) -> None:
    """Attention of each request's single query over its whole cached sequence (over
    its last ``sliding_window`` positions, when given)."""
    num_heads, head_size = query.shape[1:]
    num_kv_heads = kv_cache.shape[3]
    assert num_heads % num_kv_heads == 0 and kv_cache.shape[4] == head_size
    assert query.stride(2) == 1 and out.stride(2) == 1 and kv_cache.stride(4) == 1
    num_reqs = seq_lens.shape[0]
    if num_reqs == 0:
        return
    if num_splits is None:
        # Enough splits to give each at least one tile, at most 8.
        num_splits = max(1, min(8, triton.cdiv(max_seq_len, tile_n)))
    group = num_heads // num_kv_heads
    head_pad = triton.next_power_of_2(head_size)
    part_acc = torch.empty(
        num_reqs, num_heads, num_splits, head_size, dtype=torch.float32, device=query.device
    )
    part_max = torch.empty(
        num_reqs, num_heads, num_splits, dtype=torch.float32, device=query.device
    )
    part_sum = torch.empty_like(part_max)
    _decode_split_kernel[(num_reqs, num_kv_heads, num_splits)](
        query,
        kv_cache,
        block_table,
        seq_lens,
        query_start_loc,
        part_acc,
        part_max,
        part_sum,
        scale,
        num_heads,
        num_splits,
        query.stride(0),
        query.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_table.stride(0),
        GROUP=group,
        GROUP_PAD=triton.next_power_of_2(group),
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=kv_cache.shape[2],
        TILE_N=tile_n,
        SLIDING_WINDOW=sliding_window or 0,
    )
    _decode_merge_kernel[(num_reqs, num_heads)](
        out,
        query_start_loc,
        part_acc,
        part_max,
        part_sum,
        num_heads,
        num_splits,
        out.stride(0),
        out.stride(1),
        SPLITS_PAD=triton.next_power_of_2(num_splits),
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
    )
