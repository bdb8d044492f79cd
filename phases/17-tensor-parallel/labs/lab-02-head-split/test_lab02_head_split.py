"""Lab 17.2 — splitting attention heads, KV heads and the vocabulary over ranks.

Graded: the ``LAB 17.2`` regions of ``labs/phase_17/linear.py``
(``QKVParallelLinear``: the head counts in ``__init__``, ``shard_rank``,
``checkpoint_rows``) and ``labs/phase_17/vocab_parallel_embedding.py``
(the padded vocabulary and this rank's ids in ``VocabParallelEmbedding.__init__``,
``get_masked_input_and_mask``, ``VocabParallelEmbedding.forward``).

Against the pinned upstream's ``QKVParallelLinear`` and
``VocabParallelEmbedding`` (vllm/model_executor/layers/linear.py:975,
vocab_parallel_embedding.py:192), rank by rank, for every combination of
query heads, KV heads and ranks of a grid (every third in the fast tier):
both layers are built as rank ``r`` of ``tp`` (a stand-in group that
answers the rank and the size; the
embedding's all-reduce hands back the rank's own part, so each rank's part
is compared before the ranks' parts are added up), loaded from the same
whole tensors, and run on the same input.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
import torch.nn.functional as F

from mini_vllm.grading.checks import written
from mini_vllm.grading.tp_checks import as_rank, seeded
from mini_vllm.tiers import examples

pytestmark = pytest.mark.upstream
HEAD_SIZE, HIDDEN = 4, 8


def splits() -> list[tuple[int, int, int]]:
    """(query heads, KV heads, ranks) that upstream can split: the query
    heads divide evenly, and the KV heads divide evenly or each is shared
    by a whole number of ranks."""
    out = []
    for heads, tp in itertools.product([1, 2, 3, 4, 6, 8, 9, 12, 16, 32], [1, 2, 3, 4, 6, 8]):
        for kv in (k for k in range(1, heads + 1) if heads % k == 0):
            if heads % tp == 0 and (kv % tp == 0 if kv >= tp else tp % kv == 0):
                out.append((heads, kv, tp))
    return out


# The fast tier grades every third split of the grid (mini_vllm/tiers.py).
SPLITS = splits()[:: len(splits()) // examples(deep=len(splits()), fast=40)]


def qkv_tensors(heads: int, kv: int) -> dict[str, torch.Tensor]:
    return {
        "q": seeded(heads * HEAD_SIZE, HIDDEN, seed=1),
        "k": seeded(kv * HEAD_SIZE, HIDDEN, seed=2),
        "v": seeded(kv * HEAD_SIZE, HIDDEN, seed=3),
    }


def both_qkv(impl, heads: int, kv: int, tp: int, rank: int):
    """(yours, upstream's) as rank ``rank`` of ``tp``, loaded from the same q, k, v."""
    from vllm.model_executor.layers import linear as up_linear

    with as_rank(tp, rank):
        up = up_linear.QKVParallelLinear(HIDDEN, HEAD_SIZE, heads, kv, bias=False)
        mine = written(impl.linear.QKVParallelLinear, HIDDEN, HEAD_SIZE, heads, kv)
        for shard, tensor in qkv_tensors(heads, kv).items():
            up.weight_loader(up.weight, tensor, shard)
            written(mine.weight_loader, "weight", tensor, shard)
    return mine, up


@pytest.mark.points(4)
@pytest.mark.timeout(120)
def test_each_rank_holds_upstreams_head_counts(impl):
    for heads, kv, tp in SPLITS:
        for rank in range(tp):
            mine, up = both_qkv(impl, heads, kv, tp, rank)
            got = (mine.num_heads, mine.num_kv_heads, mine.num_kv_head_replicas)
            want = (up.num_heads, up.num_kv_heads, up.num_kv_head_replicas)
            assert got == want, (
                f"{heads} query heads, {kv} KV heads over {tp} ranks, rank {rank}: your "
                f"(num_heads, num_kv_heads, num_kv_head_replicas) is {got}, upstream's {want}"
            )


@pytest.mark.points(5)
@pytest.mark.timeout(120)
def test_each_rank_keeps_upstreams_q_k_v_rows(impl):
    x = seeded(3, HIDDEN, seed=4)
    for heads, kv, tp in SPLITS:
        for rank in range(tp):
            mine, up = both_qkv(impl, heads, kv, tp, rank)
            where = f"{heads} query heads, {kv} KV heads over {tp} ranks, rank {rank}"
            assert mine.weight.shape == up.weight.shape, (
                f"{where}: your q/k/v shard has shape {tuple(mine.weight.shape)}, upstream's "
                f"{tuple(up.weight.shape)}"
            )
            for shard in "qkv":
                rows = mine.shard_rows(shard)
                assert torch.equal(mine.weight[rows], up.weight[rows]), (
                    f"{where}: your rows of {shard!r} are not upstream's: a rank keeps its "
                    "shard_rank(shard)-th part of the checkpoint's heads"
                )
            with as_rank(tp, rank):
                assert torch.equal(mine(x), up(x)[0]), f"{where}: your output is not upstream's"


@pytest.mark.points(3)
@pytest.mark.timeout(120)
def test_fewer_kv_heads_than_ranks_are_shared_whole(impl):
    shared = [(h, kv, tp) for h, kv, tp in SPLITS if kv < tp]
    assert shared
    for heads, kv, tp in shared:
        k_whole = qkv_tensors(heads, kv)["k"]
        for rank in range(tp):
            mine, up = both_qkv(impl, heads, kv, tp, rank)
            head = rank // (tp // kv)
            want = k_whole[head * HEAD_SIZE : (head + 1) * HEAD_SIZE]
            got = mine.weight[mine.shard_rows("k")]
            assert torch.equal(got, want), (
                f"{heads} query heads, {kv} KV heads over {tp} ranks: rank {rank} must hold KV "
                f"head {head} whole (each KV head is shared by {tp // kv} consecutive ranks; "
                f"upstream's num_kv_head_replicas is {up.num_kv_head_replicas})"
            )


@pytest.mark.points(1)
def test_a_split_that_is_not_whole_is_refused(impl):
    from vllm.model_executor.layers import linear as up_linear

    for heads, kv, tp in [(9, 3, 2), (8, 3, 4), (6, 2, 4)]:
        with as_rank(tp, 0):
            with pytest.raises((AssertionError, ValueError)):
                up_linear.QKVParallelLinear(HIDDEN, HEAD_SIZE, heads, kv, bias=False)
            with pytest.raises(ValueError):
                impl.linear.QKVParallelLinear(HIDDEN, HEAD_SIZE, heads, kv)


# --- the vocabulary ------------------------------------------------------------------

VOCABS = [1, 63, 64, 65, 150, 1000, 49152]


def vocab_splits() -> list[tuple[int, int]]:
    """(vocabulary, ranks > 1) whose padded vocabulary the ranks share evenly."""
    return [
        (v, tp) for v, tp in itertools.product(VOCABS, [2, 3, 4, 8]) if -(-v // 64) * 64 % tp == 0
    ]


@contextlib.contextmanager
def plain_upstream_mask():
    """Upstream's ``get_masked_input_and_mask`` without its torch.compile
    wrapper (the same Python function; compiling it costs seconds on a CPU)."""
    from vllm.model_executor.layers import vocab_parallel_embedding as up_vocab

    compiled = up_vocab.get_masked_input_and_mask
    up_vocab.get_masked_input_and_mask = getattr(compiled, "_torchdynamo_orig_callable", compiled)
    try:
        yield up_vocab.get_masked_input_and_mask
    finally:
        up_vocab.get_masked_input_and_mask = compiled


def both_vocab(impl, vocab: int, tp: int, rank: int):
    from vllm.model_executor.layers import vocab_parallel_embedding as up_vocab

    table = seeded(vocab, HIDDEN, seed=5)
    with as_rank(tp, rank):
        up = up_vocab.VocabParallelEmbedding(vocab, HIDDEN, params_dtype=torch.float32)
        mine = written(impl.vocab_parallel_embedding.VocabParallelEmbedding, vocab, HIDDEN)
        up.weight_loader(up.weight, table)
        written(mine.weight_loader, "weight", table)
    return mine, up, table


def vocab_ids(vocab: int) -> torch.Tensor:
    return torch.unique(
        torch.tensor([0, 1, vocab // 3, vocab // 2, vocab - 2, vocab - 1]).clamp(0, vocab - 1)
    )


@pytest.mark.points(4)
@pytest.mark.timeout(120)
def test_the_vocabulary_is_padded_and_split_as_upstreams(impl):
    for vocab, tp in vocab_splits():
        for rank in range(tp):
            mine, up, _ = both_vocab(impl, vocab, tp, rank)
            where = f"a vocabulary of {vocab} over {tp} ranks, rank {rank}"
            si = up.shard_indices
            got = (
                mine.num_embeddings_padded,
                mine.num_embeddings_per_partition,
                mine.org_vocab_start_index,
                mine.org_vocab_end_index,
            )
            want = (
                up.num_embeddings_padded,
                up.num_embeddings_per_partition,
                si.org_vocab_start_index,
                si.org_vocab_end_index,
            )
            assert got == want, (
                f"{where}: your (padded vocabulary, rows a rank, first id, end id) is {got}, "
                f"upstream's {want}: pad to a multiple of 64, split evenly, padding holds no id"
            )
            assert torch.equal(mine.weight, up.weight), (
                f"{where}: your table's rows are not upstream's (its ids' rows, then zeros)"
            )


@pytest.mark.points(3)
@pytest.mark.timeout(120)
def test_masked_ids_equal_upstreams(impl):
    mask_fn = impl.vocab_parallel_embedding.get_masked_input_and_mask
    with plain_upstream_mask() as up_mask:
        for vocab, tp in vocab_splits():
            ids = torch.arange(vocab)
            for rank in range(tp):
                with as_rank(tp, rank):
                    from vllm.model_executor.layers import vocab_parallel_embedding as up_vocab

                    up = up_vocab.VocabParallelEmbedding(vocab, HIDDEN, params_dtype=torch.float32)
                si = up.shard_indices
                want = up_mask(
                    ids,
                    si.org_vocab_start_index,
                    si.org_vocab_end_index,
                    si.num_org_vocab_padding,
                    si.added_vocab_start_index,
                    si.added_vocab_end_index,
                )
                got = written(mask_fn, ids, si.org_vocab_start_index, si.org_vocab_end_index)
                for part, mine, theirs in zip(("rows", "mask"), got, want, strict=True):
                    wrong = torch.nonzero(mine != theirs).flatten()[:5].tolist()
                    assert torch.equal(mine, theirs), (
                        f"a vocabulary of {vocab} over {tp} ranks, rank {rank}: your {part} "
                        f"differ from upstream's at ids {wrong}"
                    )


@pytest.mark.points(4)
@pytest.mark.timeout(120)
def test_each_rank_embeds_its_ids_and_the_parts_add_up(impl):
    with plain_upstream_mask():
        for vocab, tp in vocab_splits():
            ids = vocab_ids(vocab)
            parts = []
            for rank in range(tp):
                mine, up, table = both_vocab(impl, vocab, tp, rank)
                with as_rank(tp, rank):
                    got, want = written(mine, ids), up(ids)
                assert torch.equal(got, want), (
                    f"a vocabulary of {vocab} over {tp} ranks, rank {rank}: your part of the "
                    "embedding (before the all-reduce) is not upstream's: the rows of the ids "
                    "this rank holds, zeros for the others"
                )
                parts.append(got)
            assert torch.equal(sum(parts), F.embedding(ids, table)), (
                f"a vocabulary of {vocab} over {tp} ranks: the ranks' parts do not add up to "
                "the whole table's rows"
            )
