"""Run a function on N gloo ranks (spawned processes) and collect what each returns.

The tensor-parallel tests use it: ``run_ranks(fn, n, *args)`` spawns ``n``
processes (torch.multiprocessing, spawn), joins them into one run through a
TCP store on a free local port (mini_vllm's ``init_distributed_environment``
and ``initialize_model_parallel(n)``), calls ``fn(rank, n, *args)`` in each,
and returns the ``n`` results in rank order. With ``upstream=True`` the
pinned vLLM's parallel state is initialised too, on the same process group,
so that upstream's layers run beside mini_vllm's. Each rank uses one CPU
thread: three ranks share this machine's two cores.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

from mini_vllm.utils.network_utils import get_open_port


def _entry(rank, fn, world_size, port, out_dir, upstream, args):
    torch.set_num_threads(1)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    from mini_vllm.distributed import parallel_state as mini_ps

    init_method = f"tcp://127.0.0.1:{port}"
    mini_ps.init_distributed_environment(world_size, rank, init_method, -1, "gloo")
    mini_ps.initialize_model_parallel(world_size)
    with contextlib.ExitStack() as stack:
        if upstream:
            from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
            from vllm.distributed import parallel_state as up_ps

            # Upstream's layers read the current config (a CPU one) when built.
            cpu_config = VllmConfig(device_config=DeviceConfig(device="cpu"))
            stack.enter_context(set_current_vllm_config(cpu_config))
            up_ps.init_distributed_environment(world_size, rank, init_method, rank, "gloo")
            up_ps.initialize_model_parallel(world_size)
        stack.enter_context(torch.no_grad())
        result = fn(rank, world_size, *args)
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    mini_ps.destroy_model_parallel()
    mini_ps.destroy_distributed_environment()


def run_ranks(fn, world_size: int, *args, upstream: bool = False) -> list:
    """``[fn(0, world_size, *args), ..., fn(world_size - 1, ...)]``, each run in its own rank."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(
            _entry,
            args=(fn, world_size, get_open_port(), out_dir, upstream, args),
            nprocs=world_size,
            join=True,
        )
        return [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(world_size)]


def collectives(rank: int, world_size: int) -> dict:
    """What each of the TP group's collectives gives on this rank."""
    from mini_vllm.distributed.parallel_state import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
        get_tp_group,
    )

    group = get_tp_group()
    mine = rank_tensor(rank)
    got = {
        "rank": get_tensor_model_parallel_rank(),
        "world_size": get_tensor_model_parallel_world_size(),
        "all_reduce": group.all_reduce(mine.clone()),
        "all_gather_0": group.all_gather(mine, dim=0),
        "all_gather_last": group.all_gather(mine, dim=-1),
        "broadcast": group.broadcast(mine.clone(), src=world_size - 1),
        "broadcast_object": group.broadcast_object({"from": rank, "text": "hi"}, src=0),
    }
    # the group's counters after those calls
    got["comm_calls"], got["comm_seconds"] = dict(group.comm_calls), dict(group.comm_seconds)
    return got


def rank_tensor(rank: int) -> torch.Tensor:
    """A [2, 3] tensor that differs from rank to rank."""
    return torch.arange(6, dtype=torch.float32).reshape(2, 3) * 10 + rank


def seeded(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def layers_against_upstream(rank: int, world_size: int, num_heads: int, num_kv_heads: int) -> dict:
    """Each parallel layer of mini_vllm and of upstream, built with the same
    sizes and loaded from the same whole tensors: this rank's weight shapes,
    whether the weights are equal, and the largest output difference."""
    from vllm.model_executor.layers import linear as up_linear
    from vllm.model_executor.layers import vocab_parallel_embedding as up_vocab
    from vllm.model_executor.layers.logits_processor import LogitsProcessor as UpLogits

    from mini_vllm.model_executor.layers import linear as mini_linear
    from mini_vllm.model_executor.layers import vocab_parallel_embedding as mini_vocab
    from mini_vllm.model_executor.layers.logits_processor import LogitsProcessor

    hidden, head_size, inter, vocab, tokens = 48, 8, 96, 150, 5
    x = seeded(tokens, hidden, seed=1)
    out: dict = {}

    def record(name, mini, up, mini_y, up_y, params=("weight",)):
        if isinstance(up_y, tuple):
            up_y = up_y[0]
        out[name] = {
            "shapes": {
                p: (tuple(getattr(mini, p).shape), tuple(getattr(up, p).shape)) for p in params
            },
            "weights_equal": all(torch.equal(getattr(mini, p), getattr(up, p)) for p in params),
            "max_diff": (mini_y - up_y).abs().max().item(),
            "mini_y": mini_y,
        }

    # ColumnParallelLinear, with and without gathering its output.
    w, b = seeded(inter, hidden, seed=2), seeded(inter, seed=3)
    for gather in (False, True):
        mini = mini_linear.ColumnParallelLinear(hidden, inter, bias=True, gather_output=gather)
        up = up_linear.ColumnParallelLinear(hidden, inter, bias=True, gather_output=gather)
        for layer in (mini, up):
            layer.weight_loader(*(("weight", w) if layer is mini else (up.weight, w)))
            layer.weight_loader(*(("bias", b) if layer is mini else (up.bias, b)))
        record(f"column gather={gather}", mini, up, mini(x), up(x), ("weight", "bias"))

    # MergedColumnParallelLinear (gate, up).
    gate, upw = seeded(inter, hidden, seed=4), seeded(inter, hidden, seed=5)
    mini = mini_linear.MergedColumnParallelLinear(hidden, [inter, inter])
    up = up_linear.MergedColumnParallelLinear(hidden, [inter, inter], bias=False)
    for shard, tensor in enumerate((gate, upw)):
        mini.weight_loader("weight", tensor, shard)
        up.weight_loader(up.weight, tensor, shard)
    record("merged column", mini, up, mini(x), up(x))

    # QKVParallelLinear: as many KV heads as asked, and a single KV head
    # (replicated on every rank).
    for kv in sorted({num_kv_heads, 1}):
        q = seeded(num_heads * head_size, hidden, seed=6)
        k = seeded(kv * head_size, hidden, seed=7)
        v = seeded(kv * head_size, hidden, seed=8)
        mini = mini_linear.QKVParallelLinear(hidden, head_size, num_heads, kv)
        up = up_linear.QKVParallelLinear(hidden, head_size, num_heads, kv, bias=False)
        for shard, tensor in zip("qkv", (q, k, v), strict=True):
            mini.weight_loader("weight", tensor, shard)
            up.weight_loader(up.weight, tensor, shard)
        record(f"qkv heads={num_heads} kv_heads={kv}", mini, up, mini(x), up(x))
        out[f"qkv heads={num_heads} kv_heads={kv}"]["heads"] = (
            (mini.num_heads, mini.num_kv_heads, mini.num_kv_head_replicas),
            (up.num_heads, up.num_kv_heads, up.num_kv_head_replicas),
        )

    # RowParallelLinear: this rank's slice of the input, bias, all-reduce.
    w, b = seeded(hidden, inter, seed=9), seeded(hidden, seed=10)
    x_inter = seeded(tokens, inter, seed=11)
    part = inter // world_size
    x_part = x_inter[:, rank * part : (rank + 1) * part]
    mini = mini_linear.RowParallelLinear(inter, hidden, bias=True)
    up = up_linear.RowParallelLinear(inter, hidden, bias=True)
    mini.weight_loader("weight", w)
    mini.weight_loader("bias", b)
    up.weight_loader(up.weight, w)
    up.weight_loader(up.bias, b)
    record("row", mini, up, mini(x_part), up(x_part), ("weight", "bias"))

    # VocabParallelEmbedding (the vocabulary padded to 192 and split) and the
    # LM head's logits, gathered.
    table = seeded(vocab, hidden, seed=12)
    ids = torch.tensor([0, 1, 63, 64, 95, 96, 127, 128, 149, 7])
    mini = mini_vocab.VocabParallelEmbedding(vocab, hidden)
    up = up_vocab.VocabParallelEmbedding(vocab, hidden, params_dtype=torch.float32)
    mini.weight_loader("weight", table)
    up.weight_loader(up.weight, table)
    record("vocab embedding", mini, up, mini(ids), up(ids))
    mini_head = mini_vocab.ParallelLMHead(vocab, hidden)
    up_head = up_vocab.ParallelLMHead(vocab, hidden, params_dtype=torch.float32)
    mini_head.weight_loader("weight", table)
    up_head.weight_loader(up_head.weight, table)
    record(
        "lm head logits",
        mini_head,
        up_head,
        LogitsProcessor(vocab)(mini_head, x),
        UpLogits(vocab)(up_head, x),
    )
    return out
