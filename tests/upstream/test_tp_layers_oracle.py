"""Phase 17: mini_vllm's parallel layers against the pinned upstream's, rank by rank.

On N gloo ranks (spawned processes), upstream's parallel state is set up on
the same process group as mini_vllm's; each rank builds every parallel
layer twice (upstream's ``vllm.model_executor.layers.linear`` /
``vocab_parallel_embedding`` / ``logits_processor``, and mini_vllm's) with
the same sizes, loads both from the same whole checkpoint tensors through
their ``weight_loader``, and runs both on the same input. On every rank the
shard shapes, the sharded weights and the outputs must be equal: column,
column with a gathered output, merged gate/up, q/k/v (KV heads split, and a
single KV head replicated), row (bias on rank 0, all-reduced), the
vocabulary-split embedding (padded to 64) and the gathered logits.
TP=2 (6 query heads, 2 KV heads) runs in the fast tier; TP=3 with
SmolLM2's 9 query and 3 KV heads in the deep tier.
"""

from __future__ import annotations

import pytest
from tp_workers import layers_against_upstream, run_ranks

pytestmark = pytest.mark.upstream


@pytest.mark.parametrize(
    "tp, num_heads, num_kv_heads",
    [(2, 6, 2), pytest.param(3, 9, 3, marks=pytest.mark.deep)],
)
def test_parallel_layers_equal_upstream_per_rank(tp, num_heads, num_kv_heads):
    results = run_ranks(layers_against_upstream, tp, num_heads, num_kv_heads, upstream=True)
    for rank, layers in enumerate(results):
        for name, got in layers.items():
            for param, (mini_shape, up_shape) in got["shapes"].items():
                assert mini_shape == up_shape, (
                    f"rank {rank}, {name}: {param} shard shape {mini_shape}, upstream's {up_shape}"
                )
            assert got["weights_equal"], f"rank {rank}, {name}: the loaded shard differs"
            assert got["max_diff"] <= 1e-5, (
                f"rank {rank}, {name}: output differs from upstream's by {got['max_diff']:.2e}"
            )
            if "heads" in got:
                assert got["heads"][0] == got["heads"][1], (
                    f"rank {rank}, {name}: (heads, KV heads, KV replicas) {got['heads'][0]}, "
                    f"upstream's {got['heads'][1]}"
                )
    # The split is real: with a gathered output or an all-reduce every rank
    # holds the same whole result; a column layer's own output is a slice.
    assert (
        results[0]["column gather=False"]["mini_y"].shape[-1] * tp
        == (results[0]["column gather=True"]["mini_y"].shape[-1])
    )
