"""Merge two partial attention results by their log-sum-exp, and the online
softmax built on that merge (torch, the reference for the kernels' inner loops).

Mirrors upstream ``vllm/v1/attention/ops/merge_attn_states.py`` (``merge_attn_states``
:9) at v0.22.1, with the semantics of the Triton kernel it falls back to off
CUDA (``merge_attn_states_kernel`` (triton_merge_attn_states.py:58)). Left
out: FP8 output (``output_scale``) and ``prefill_tokens_with_context`` (upstream
copies the suffix for tokens past it; here every token is merged).

A partial result over a subset S of the keys is ``(out_S, lse_S)``: the
softmax-weighted mean of the values in S, and ``lse_S = log sum_{j in S}
exp(score_j)``. Two disjoint subsets merge exactly::

    lse = log(exp(lse_P) + exp(lse_S))
    out = exp(lse_P - lse) * out_P + exp(lse_S - lse) * out_S

Shapes, as upstream: outputs ``[num_tokens, num_heads, head_size]``, LSEs
``[num_heads, num_tokens]`` (float32). An empty subset has ``lse = -inf``
and weighs zero; ``+inf`` is read as ``-inf`` (upstream: FlashAttention-2
reports an empty subset that way). If both sides are empty the result is
NaN, as in upstream's Triton kernel.

``tiled_attention`` runs one pass over the keys in tiles, folding each
tile's partial result into a running one with ``merge_attn_states``: the
online softmax of FlashAttention and of every kernel in ``ops/``.
"""

from __future__ import annotations

import torch


# BEGIN LAB 04.1: merge two partial attention results (online softmax)
def merge_attn_states(
    output: torch.Tensor,  # [num_tokens, num_heads, head_size], written in place
    prefix_output: torch.Tensor,  # [num_tokens, num_heads, head_size]
    prefix_lse: torch.Tensor,  # [num_heads, num_tokens]
    suffix_output: torch.Tensor,  # [num_tokens, num_heads, head_size]
    suffix_lse: torch.Tensor,  # [num_heads, num_tokens]
    output_lse: torch.Tensor | None = None,  # [num_heads, num_tokens], written if given
) -> None:
    """Write the attention over prefix + suffix keys into ``output`` (and its
    LSE into ``output_lse``), given the two partial results."""
    # HINT: work in float32; an lse of +inf means an empty side: make it -inf.
    # HINT: subtract the larger lse before exp (no overflow), then
    # HINT: out = p_se / (p_se + s_se) * prefix + s_se / (p_se + s_se) * suffix.
    # HINT: the LSEs are [heads, tokens] while outputs are [tokens, heads, dim].
    inf = float("inf")
    p_lse = prefix_lse.float().masked_fill(prefix_lse == inf, -inf)
    s_lse = suffix_lse.float().masked_fill(suffix_lse == inf, -inf)
    max_lse = torch.maximum(p_lse, s_lse)
    p_se = torch.exp(p_lse - max_lse)
    s_se = torch.exp(s_lse - max_lse)
    out_se = p_se + s_se
    if output_lse is not None:
        output_lse.copy_(torch.log(out_se) + max_lse)
    # Scale first, then multiply (as upstream: never exp(lse) * out directly).
    p_scale = (p_se / out_se).t().unsqueeze(-1)  # [tokens, heads, 1]
    s_scale = (s_se / out_se).t().unsqueeze(-1)
    out = prefix_output.float() * p_scale + suffix_output.float() * s_scale
    output.copy_(out.to(output.dtype))


# END LAB 04.1


def attention_with_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over all the given keys, in float32, with its LSE.

    query ``[T, H, D]``, key/value ``[N, H, D]``, mask ``[T, N]`` (True = visible).
    Returns out ``[T, H, D]`` and lse ``[H, T]``; a row that sees no key gets
    out 0 and lse -inf (an empty partial result).
    """
    s = torch.einsum("thd,nhd->htn", query.float(), key.float()) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [H, T]
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # empty row: exp(-inf - -inf) = nan
    return torch.einsum("htn,nhd->thd", p, value.float()), lse


def tiled_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    tile_size: int,
    causal: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention in one pass over ``tile_size`` keys at a time (online softmax).

    The T queries are the last T positions of the N keys: with ``causal``,
    query t (position N - T + t) sees keys 0 .. N - T + t. The running
    result starts empty (lse -inf) and absorbs one tile's partial result per
    step, so no score matrix wider than a tile ever exists.
    """
    T, H, D = query.shape
    N = key.shape[0]
    out = torch.zeros(T, H, D, dtype=torch.float32, device=query.device)
    lse = torch.full((H, T), float("-inf"), dtype=torch.float32, device=query.device)
    q_pos = torch.arange(N - T, N, device=query.device)
    for start in range(0, N, tile_size):
        k_pos = torch.arange(start, min(N, start + tile_size), device=query.device)
        mask = k_pos[None, :] <= q_pos[:, None] if causal else None
        tile_out, tile_lse = attention_with_lse(query, key[k_pos], value[k_pos], scale, mask)
        merge_attn_states(out, out.clone(), lse.clone(), tile_out, tile_lse, lse)
    return out, lse
