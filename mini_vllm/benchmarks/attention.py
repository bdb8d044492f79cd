"""The attention backends measured: error by dtype, and time, torch vs Triton.

``python -m mini_vllm.benchmarks.attention`` (``--quick`` for the notebook's
small sizes). One decode step over a batch of requests whose context is
already in the paged cache (random, shuffled block ids), run by:

- ``torch``: ``TorchAttentionImpl``, the reference (gather through the block
  table, float32 softmax, one request at a time);
- ``triton``: ``decode_attention`` (ops/triton_decode_attention.py), the
  split-KV kernel, at a given ``num_splits``.

Accuracy: the max absolute error of each against attention computed from
its definition in float64 on the same (dtype-rounded) keys and values, by
dtype and context length, and of the kernel by ``num_splits``.

Time: the median of ``repeats`` runs of each, after a warm-up, and the
ratio torch / triton measured in the same run. On CUDA the kernels are
compiled and timed with ``torch.cuda.synchronize``; on CPU they run under
Triton's interpreter (``TRITON_INTERPRET=1``, which this module sets when
there is no CUDA), which executes the kernel in numpy one program at a
time: those times say nothing about the kernel's speed, only that it runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from functools import partial

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from mini_vllm.attention.backend import AttentionMetadata, get_kv_cache_shape  # noqa: E402
from mini_vllm.attention.backends.torch_attn import TorchAttentionImpl  # noqa: E402
from mini_vllm.attention.ops.triton_decode_attention import decode_attention  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def decode_batch(
    num_reqs: int,
    context_len: int,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    head_size: int = 64,
    block_size: int = 16,
    dtype=torch.float32,
    device: str = "cpu",
    seed: int = 0,
):
    """query [num_reqs, H, D], the filled cache, metadata, and the unpaged K/V
    ([num_reqs, context_len, H_kv, D]) for the oracle. Each request's query
    is its token at position context_len - 1, whose K/V is already stored."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-context_len // block_size)
    num_blocks = 1 + num_reqs * blocks
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).view(num_reqs, blocks)
    k = torch.randn(num_reqs, context_len, num_kv_heads, head_size, generator=g).to(dtype)
    v = torch.randn(num_reqs, context_len, num_kv_heads, head_size, generator=g).to(dtype)
    cache = torch.zeros(
        get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size), dtype=dtype
    )
    pos = torch.arange(context_len)
    for i in range(num_reqs):
        cache[ids[i, pos // block_size], 0, pos % block_size] = k[i]
        cache[ids[i, pos // block_size], 1, pos % block_size] = v[i]
    q = torch.randn(num_reqs, num_heads, head_size, generator=g).to(dtype)
    last = ids[:, (context_len - 1) // block_size] * block_size + (context_len - 1) % block_size
    md = AttentionMetadata(
        num_actual_tokens=num_reqs,
        max_query_len=1,
        query_start_loc=torch.arange(num_reqs + 1, dtype=torch.int32, device=device),
        max_seq_len=context_len,
        seq_lens=torch.full((num_reqs,), context_len, dtype=torch.int32, device=device),
        block_table=ids.to(torch.int32).to(device),
        slot_mapping=last.to(device),
    )
    return q.to(device), cache.to(device), md, k, v


def oracle(q, k, v) -> torch.Tensor:
    """float64 softmax attention of each request's one query over all its keys."""
    group = q.shape[1] // k.shape[2]
    kk = k.double().repeat_interleave(group, dim=2)  # [R, N, H, D]
    vv = v.double().repeat_interleave(group, dim=2)
    s = torch.einsum("rhd,rnhd->rhn", q.double().cpu(), kk) * q.shape[-1] ** -0.5
    return torch.einsum("rhn,rnhd->rhd", torch.softmax(s, -1), vv)


def run_torch(q, cache, md):
    """The reference backend's forward; the step's "new" K/V is read back
    from its slot, so storing it again changes nothing."""
    impl = TorchAttentionImpl(q.shape[1], q.shape[2], q.shape[2] ** -0.5, cache.shape[3])
    blocks, offsets = md.slot_mapping // cache.shape[2], md.slot_mapping % cache.shape[2]
    return impl.forward(q, cache[blocks, 0, offsets], cache[blocks, 1, offsets], cache, md)


def run_triton(q, cache, md, num_splits=None, tile_n=32):
    out = torch.empty_like(q)
    decode_attention(
        out,
        q,
        cache,
        md.block_table,
        md.seq_lens,
        md.query_start_loc,
        md.max_seq_len,
        q.shape[2] ** -0.5,
        num_splits=num_splits,
        tile_n=tile_n,
    )
    return out


def kernel_vs_torch(
    seeds=range(8), context_lens=(1, 8, 21, 53), num_splits=(1, 3, 4, 9), device="cpu"
) -> dict[str, float]:
    """max |triton - torch| by dtype over the shapes lab 04.3 grades (GQA 6/2,
    head_size 16, block_size 4, tiles of 16): the basis of its tolerances."""
    worst = {}
    for name, dtype in DTYPES.items():
        worst[name] = 0.0
        for seed in seeds:
            for n in context_lens:
                q, cache, md, _, _ = decode_batch(2, n, 6, 2, 16, 4, dtype, device, seed)
                want = run_torch(q, cache, md).float()
                for s in num_splits:
                    err = (run_triton(q, cache, md, s, tile_n=16).float() - want).abs().max()
                    worst[name] = max(worst[name], err.item())
    return worst


def accuracy(
    context_lens, dtypes=tuple(DTYPES), num_splits=(None,), num_reqs=2, device="cpu", **shape
) -> list[dict]:
    rows = []
    for name in dtypes:
        for n in context_lens:
            q, cache, md, k, v = decode_batch(
                num_reqs, n, dtype=DTYPES[name], device=device, **shape
            )
            want = oracle(q, k, v)
            row = {
                "dtype": name,
                "context_len": n,
                "torch": (run_torch(q, cache, md).double().cpu() - want).abs().max().item(),
            }
            for s in num_splits:
                err = (run_triton(q, cache, md, s).double().cpu() - want).abs().max().item()
                row[f"triton splits={s or 'auto'}"] = err
            rows.append(row)
    return rows


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up (compiles the kernel on CUDA)
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def timing(
    context_lens, num_reqs=4, dtype="float32", repeats=5, device="cpu", **shape
) -> list[dict]:
    rows = []
    for n in context_lens:
        q, cache, md, _, _ = decode_batch(num_reqs, n, dtype=DTYPES[dtype], device=device, **shape)
        t_torch = median_ms(partial(run_torch, q, cache, md), repeats)
        t_triton = median_ms(partial(run_triton, q, cache, md), repeats)
        rows.append(
            {
                "context_len": n,
                "torch_ms": t_torch,
                "triton_ms": t_triton,
                "torch/triton": t_torch / t_triton,
            }
        )
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (CPU interpreter)")
    ap.add_argument(
        "--tolerances",
        action="store_true",
        help="only max |triton - torch| by dtype on lab 04.3's shapes",
    )
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.tolerances:
        for name, err in kernel_vs_torch(device=device).items():
            print(f"{name}: max |triton - torch| = {err:.2e}")
        return
    quick = args.quick or device == "cpu"
    lens = [16, 64, 256] if quick else [128, 1024, 4096, 16384]
    shape = dict(head_size=32) if quick else {}
    print(
        f"device {device}"
        + ("" if device == "cuda" else " (Triton interpreter: times are NOT kernel performance)")
    )
    print("max abs error vs float64 attention, decode, by dtype and context length:")
    for row in accuracy(lens, num_splits=(1, 4, None), device=device, **shape):
        print(
            "  "
            + ", ".join(
                f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
            )
        )
    print(
        f"median ms of one decode step ({'4' if quick else '32'} requests, float32"
        f"{', bfloat16 on cuda' if device == 'cuda' else ''}):"
    )
    for dtype in ["float32"] if device == "cpu" else ["float32", "bfloat16"]:
        for row in timing(
            lens,
            num_reqs=4 if quick else 32,
            dtype=dtype,
            device=device,
            repeats=3 if quick else 20,
            **shape,
        ):
            print(
                f"  {dtype} context {row['context_len']}: torch {row['torch_ms']:.3f} ms, "
                f"triton {row['triton_ms']:.3f} ms, torch/triton {row['torch/triton']:.3g}"
            )


if __name__ == "__main__":
    main()
