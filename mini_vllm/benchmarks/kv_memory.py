"""The KV-memory calculator: bytes per token of real models, and how many requests fit.

    python -m mini_vllm.benchmarks.kv_memory [--gpu-gib 80] [--utilization 0.9]
                                             [--context 4096] [--block-size 16]

A course module (Phase 00, Lab 00.2); no upstream counterpart. It reads the
config facts committed in ``data/model_configs.json`` (layers, KV heads,
head size, dtype of each model's public config.json) and prints, per
model, with mini_vllm's ``kv_cache_interface`` (the code the engine sizes
its own cache with):

- bytes of KV cache per token (all layers, keys and values);
- the KV blocks ``utilization * gpu_gib`` GiB holds (upstream's
  ``get_num_blocks``), an upper bound: a real server first subtracts the
  weights and the activation peak (upstream's ``determine_available_memory``);
- how many requests of ``context`` tokens fit at once
  (``num_requests_that_fit``: the null block excluded), beside upstream's
  "Maximum concurrency" figure (``get_max_concurrency_for_kv_cache_config``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from mini_vllm.kv_cache_interface import (
    FullAttentionSpec,
    get_max_concurrency_for_kv_cache_config,
    get_num_blocks,
    kv_cache_bytes_per_token,
    num_requests_that_fit,
)

MODEL_CONFIGS = Path(__file__).parent / "data" / "model_configs.json"
GIB = 1 << 30


def load_model_configs() -> list[dict]:
    return json.loads(MODEL_CONFIGS.read_text())["models"]


def spec_for(
    cfg: dict,
    block_size: int = 16,
    dtype: torch.dtype | None = None,
    spec_cls: type = FullAttentionSpec,
) -> FullAttentionSpec:
    """The KV spec of one layer of the model ``cfg`` describes (its own dtype by default)."""
    return spec_cls(
        block_size=block_size,
        num_kv_heads=cfg["num_key_value_heads"],
        head_size=cfg["head_dim"],
        dtype=dtype or getattr(torch, cfg["torch_dtype"]),
    )


def table(
    gpu_gib: float = 80, utilization: float = 0.9, context: int = 4096, block_size: int = 16
) -> list[dict]:
    budget = int(gpu_gib * GIB * utilization)
    rows = []
    for cfg in load_model_configs():
        spec, layers = spec_for(cfg, block_size), cfg["num_hidden_layers"]
        num_blocks = get_num_blocks(layers, budget, spec.page_size_bytes)
        rows.append(
            {
                "model": cfg["name"],
                "layers": layers,
                "kv_heads": cfg["num_key_value_heads"],
                "head_dim": cfg["head_dim"],
                "dtype": cfg["torch_dtype"],
                "bytes_per_token": kv_cache_bytes_per_token(spec, layers),
                "num_blocks": num_blocks,
                "requests": num_requests_that_fit(num_blocks, spec, context),
                "upstream_max_concurrency": get_max_concurrency_for_kv_cache_config(
                    num_blocks, spec, layers, context
                ),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu-gib", type=float, default=80)
    parser.add_argument("--utilization", type=float, default=0.9)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args(argv)
    rows = table(args.gpu_gib, args.utilization, args.context, args.block_size)
    print(
        f"KV budget {args.utilization} x {args.gpu_gib:g} GiB (weights not subtracted), "
        f"block_size {args.block_size}, requests of {args.context} tokens\n"
    )
    print(
        "| model | layers | KV heads | head dim | dtype | KV bytes/token | blocks "
        "| requests that fit | upstream's max concurrency |"
    )
    print("| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['model']} | {r['layers']} | {r['kv_heads']} | {r['head_dim']} | {r['dtype']} "
            f"| {r['bytes_per_token']:,.0f} | {r['num_blocks']:,} | {r['requests']:,} "
            f"| {r['upstream_max_concurrency']:,.2f}x |"
        )


if __name__ == "__main__":
    main()
