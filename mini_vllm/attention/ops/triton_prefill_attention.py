"""Paged causal attention for a flat batch of any query lengths (a Triton kernel).

Mirrors upstream ``vllm/v1/attention/ops/triton_unified_attention.py``
(``kernel_unified_attention`` :179 on its 2D path, launched by
``unified_attention`` :763) at v0.22.1. Left out: the split-KV "3D" path and
its ``reduce_segments`` :646 (our decode kernel shows that idea), the binary search
that maps a flat grid to requests, sliding windows, ALiBi, soft-capping,
sinks, FP8, tensor descriptors and every tuning heuristic.

Each request's new tokens sit at positions ``seq_len - q_len .. seq_len - 1``
and attend causally over keys ``0 .. their position``, read from the paged
cache through ``block_table`` (the new tokens must already be stored there).

Invariants:
- a program owns (request, block of query tokens, KV head); it never writes
  another request's rows, and rows past ``q_len`` are left untouched;
- keys past the last query position of the program are never loaded, so
  stale or NaN slots in the cache cannot leak into the output;
- softmax statistics and the accumulator stay in float32; only the dot
  operands use the input dtype (and P is rounded to it, as on tensor cores).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _dot(a, b, acc, DOT_FP32: tl.constexpr):
    # acc + a @ b with a float32 accumulator. DOT_FP32 runs it on float32
    # operands in full IEEE precision (no TF32 shortcut on the GPU).
    if DOT_FP32:
        res = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        res = tl.dot(a, b, acc)
    return res


@triton.jit
def _prefill_kernel(
    out_ptr,
    q_ptr,
    kv_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale,
    q_stride_tok,
    q_stride_head,
    out_stride_tok,
    out_stride_head,
    cache_stride_block,
    cache_stride_kv,
    cache_stride_slot,
    cache_stride_head,
    block_table_stride,
    max_blocks_per_req,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of 2
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # HEAD_SIZE rounded up to a power of 2 (>= 16)
    BLOCK_SIZE: tl.constexpr,  # tokens per KV-cache block
    BLOCK_Q: tl.constexpr,  # query tokens per program
    TILE_N: tl.constexpr,  # keys per inner-loop step
    DOT_FP32: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr = 0,  # 0: full attention; w: the last w positions only
):
    req = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return  # the grid is sized for the longest request; this one is shorter
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len  # tokens already cached before this step

    # Tiling of the queries. The program's tile has BLOCK_Q * GROUP_PAD rows:
    # row r is query token r // GROUP_PAD with query head r % GROUP_PAD of
    # this KV head's group. Every head of a group reads the same keys (GQA),
    # so one K/V tile load serves them all and the dot gets more rows.
    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    q_idx = q_block * BLOCK_Q + rows // GROUP_PAD  # token index within the request
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (q_idx < q_len) & (rows % GROUP_PAD < GROUP)
    q_pos = context_len + q_idx  # position in the sequence
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_SIZE

    tok = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * q_stride_tok + head[:, None] * q_stride_head + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )

    # Online softmax state per row: running max m, running sum of
    # exp(score - m) l, and the unnormalised output acc = sum exp(score - m) * v.
    m = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_Q * GROUP_PAD], dtype=tl.float32)  # noqa: E741 (l: the softmax sum, as in the phase 04 text)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_PAD], dtype=tl.float32)

    # Causality bounds the keys: the last query of this block sits at
    # context_len + (q_block + 1) * BLOCK_Q - 1, so no key at or past kv_end
    # is needed (and none is loaded).
    kv_end = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_Q)
    bt_row = block_table_ptr + req.to(tl.int64) * block_table_stride
    for tile in range(0, tl.cdiv(kv_end, TILE_N)):
        # Tiling of the keys: TILE_N consecutive positions, which may span
        # several KV blocks; each key finds its block through the table.
        k_pos = tile * TILE_N + tl.arange(0, TILE_N)
        k_ok = k_pos < kv_end
        block = tl.load(
            bt_row + k_pos // BLOCK_SIZE,
            mask=k_ok & (k_pos // BLOCK_SIZE < max_blocks_per_req),
            other=0,
        )
        slot = block.to(tl.int64) * cache_stride_block + (k_pos % BLOCK_SIZE) * cache_stride_slot
        kv_ptr = kv_cache_ptr + slot[:, None] + kv_head * cache_stride_head + dims[None, :]
        kv_mask = k_ok[:, None] & dim_ok[None, :]
        k = tl.load(kv_ptr, mask=kv_mask, other=0.0).to(q.dtype)  # [TILE_N, HEAD_PAD]
        v = tl.load(kv_ptr + cache_stride_kv, mask=kv_mask, other=0.0).to(q.dtype)

        s = (
            _dot(q, tl.trans(k), tl.zeros([BLOCK_Q * GROUP_PAD, TILE_N], tl.float32), DOT_FP32)
            * scale
        )
        # Causal mask (it also hides the unloaded keys >= kv_end for every
        # real row, since a real row's position is < kv_end).
        s = tl.where(k_pos[None, :] <= q_pos[:, None], s, float("-inf"))
        if SLIDING_WINDOW > 0:
            # Keys older than the window are hidden too (a row may then see no
            # key in this tile: m_ref below keeps that row finite).
            s = tl.where(k_pos[None, :] > q_pos[:, None] - SLIDING_WINDOW, s, float("-inf"))

        # Online-softmax rescaling: if this tile raises a row's max from m to
        # m_new, everything summed so far was weighted by exp(. - m) and must
        # be multiplied by alpha = exp(m - m_new) to be on the new scale.
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # A row with no visible key yet (only padding rows) keeps m_new = -inf;
        # subtracting 0 instead avoids -inf - -inf = NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_ref)
        p = tl.exp(s - m_ref[:, None])  # [rows, TILE_N], in [0, 1]
        l = l * alpha + tl.sum(p, axis=1)  # noqa: E741 (l: the softmax sum, as in the phase 04 text)
        # P is rounded to the input dtype so the second dot runs on the same
        # operand type as the first (tensor cores on the GPU).
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], DOT_FP32)
        m = m_new

    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    tl.store(
        out_ptr + tok[:, None] * out_stride_tok + head[:, None] * out_stride_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


def prefill_attention(
    out: torch.Tensor,  # [num_tokens, num_heads, head_size], written in place
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
    block_table: torch.Tensor,  # int32 [num_reqs, max_blocks_per_req]
    seq_lens: torch.Tensor,  # int32 [num_reqs]
    query_start_loc: torch.Tensor,  # int32 [num_reqs + 1]
    max_query_len: int,
    scale: float,
    block_m: int = 32,
    tile_n: int = 32,
    sliding_window: int | None = None,
) -> None:
    """Causal paged attention for every request's new tokens (rows up to query_start_loc[-1]);
    with ``sliding_window`` w, a query at position p sees positions p-w+1..p only."""
    num_heads, head_size = query.shape[1:]
    num_kv_heads = kv_cache.shape[3]
    assert num_heads % num_kv_heads == 0 and kv_cache.shape[4] == head_size
    assert query.stride(2) == 1 and out.stride(2) == 1 and kv_cache.stride(4) == 1
    num_reqs = seq_lens.shape[0]
    if num_reqs == 0 or max_query_len == 0:
        return
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    # Rows per program = BLOCK_Q * GROUP_PAD >= block_m (tl.dot on the GPU wants >= 16).
    block_q = max(1, block_m // group_pad)
    # Triton's interpreter cannot multiply bfloat16 operands in tl.dot (it
    # sees their raw bits), so on CPU bf16 dots are done in float32; float32
    # inputs always use full-precision dots.
    dot_fp32 = query.dtype == torch.float32 or (query.dtype == torch.bfloat16 and not query.is_cuda)
    grid = (num_reqs, triton.cdiv(max_query_len, block_q), num_kv_heads)
    _prefill_kernel[grid](
        out,
        query,
        kv_cache,
        block_table,
        seq_lens,
        query_start_loc,
        scale,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_table.stride(0),
        block_table.shape[1],
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_SIZE=head_size,
        HEAD_PAD=max(16, triton.next_power_of_2(head_size)),
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_Q=block_q,
        TILE_N=tile_n,
        DOT_FP32=dot_fp32,
        SLIDING_WINDOW=sliding_window or 0,
    )
