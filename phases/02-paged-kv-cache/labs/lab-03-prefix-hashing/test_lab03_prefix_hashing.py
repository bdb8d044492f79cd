"""Lab 02.3 — prefix caching: block hashes, the cache, the longest cached prefix.

Graded: the ``LAB 02.3`` regions of ``labs/phase_02/``:

- ``kv_cache_utils.py``: ``hash_block_tokens`` and the body of the request
  block hasher (``get_request_block_hasher``);
- ``block_pool.py``: ``get_cached_block`` and ``cache_full_blocks``;
- ``kv_cache_manager.py``: ``get_computed_blocks`` and ``cache_blocks``.

The free queue, the pool's allocation and eviction (Labs 02.1, 02.2) and
``allocate_slots`` (Lab 02.4) hold the reference's code while this lab is
graded; the reference ``allocate_slots`` calls your ``cache_blocks``.

A full block's hash covers its tokens AND the hash of the block before it,
so equal hashes mean equal prefixes, and a lookup can walk a request's
hashes from the start and stop at the first miss. Read the tests top to
bottom: the hash bytes against upstream's, the request hasher, the
cache's bookkeeping, the lookup's rules, two hypothesis properties (hits
against a brute-force prefix match; your KV cache against the reference on
generated workloads) and upstream's recorded traces.
"""

from __future__ import annotations

import types

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.internal.conjecture import engine as hypothesis_engine

from mini_vllm.core.kv_cache_utils import NONE_HASH, sha256
from mini_vllm.grading import kv_checks
from mini_vllm.grading.checks import lab_settings
from mini_vllm.oracle import kv_snapshots
from mini_vllm.oracle.kv_strategies import kv_workloads
from mini_vllm.testing import cache_key, first_hit

PROPERTY = lab_settings(120, shrink=True)
SHRINK_SECONDS = 10
BS = 4


# ------------------------------------------------------------------ helpers


def prompt(tag: int, n: int) -> list[int]:
    return [100 * tag + i % 100 for i in range(n)]


def manager(impl, num_blocks: int = 32, caching: bool = True, max_model_len: int = 128):
    return kv_checks.build_manager(
        impl,
        block_size=BS,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        enable_caching=caching,
    )


def request(impl, req_id: str, tokens: list[int]):
    return kv_checks.request_factory(impl, BS)(req_id, tokens)


def run_whole(mgr, req):
    """Admit ``req`` the way the scheduler does: look it up, then allocate
    the rest of its prompt (the reference allocate_slots calls your cache_blocks)."""
    hits, n = mgr.get_computed_blocks(req)
    assert mgr.allocate_slots(req, req.num_tokens - n, n, hits) is not None, "setup: no room"
    req.num_computed_tokens = req.num_tokens
    return hits, n


def ids(kv_blocks) -> list[int]:
    return list(kv_blocks.get_block_ids()[0])


def h(i: int) -> bytes:
    return bytes([i]) * 32


# ------------------------------------------------------------- block hashes

UPSTREAM = "last_token_is_recomputed"  # request "a": 12 tokens, block size 4


@pytest.mark.points(2)
def test_hash_block_tokens_gives_upstreams_bytes(impl):
    workload, header, trace = kv_snapshots.load(kv_snapshots.path_of(UPSTREAM))
    tokens = dict(workload.requests)["a"]
    expected = trace["final"]["a"]["block_hashes"]
    parent, got = None, []
    for i in range(len(tokens) // BS):
        parent = impl.kv_cache_utils.hash_block_tokens(
            sha256, parent, tokens[i * BS : (i + 1) * BS]
        )
        got.append(bytes(parent).hex())
    assert got == expected, (
        f"The three block hashes of the prompt {tokens} (block size 4), chained, must be the "
        f"bytes upstream vLLM {header['vllm_version']} computed (recorded in "
        f"tests/snapshots/kv_cache/{UPSTREAM}.json): sha256 of the triple (parent hash, or "
        f"NONE_HASH for the first block; the block's tokens as a TUPLE; extra_keys, None "
        f"here).\n  upstream: {[x[:16] + '...' for x in expected]}\n  yours:    "
        f"{[x[:16] + '...' for x in got]}"
    )


@pytest.mark.points(1)
def test_the_first_block_chains_on_none_hash_and_the_parent_matters(impl):
    f = impl.kv_cache_utils.hash_block_tokens
    assert f(sha256, None, [1, 2, 3, 4]) == sha256((NONE_HASH, (1, 2, 3, 4), None)), (
        "A first block has no parent: hash (NONE_HASH, tokens as a tuple, extra_keys)."
    )
    assert f(sha256, h(1), [5, 6, 7, 8]) != f(sha256, h(2), [5, 6, 7, 8]), (
        "The same tokens after different parents must hash differently: the parent hash is "
        "part of the key, so a hash stands for the whole prefix, not just one block."
    )
    assert f(sha256, h(1), [5, 6, 7, 8], ("lora", 3)) != f(sha256, h(1), [5, 6, 7, 8]), (
        "extra_keys are part of the key too."
    )


@pytest.mark.points(2)
def test_a_request_hashes_each_full_block_once(impl):
    req = request(impl, "r", prompt(1, 10))
    f = impl.kv_cache_utils.hash_block_tokens
    b0 = f(sha256, None, prompt(1, 10)[:4])
    b1 = f(sha256, b0, prompt(1, 10)[4:8])
    assert req.block_hashes == [b0, b1], (
        f"A 10-token prompt (block size 4) has 2 full blocks: the hasher returns 2 chained "
        f"hashes at creation; the 2 leftover tokens are not a block yet. Got "
        f"{len(req.block_hashes)} hashes"
        + ("" if len(req.block_hashes) != 2 else " with other values")
        + "."
    )
    req.append_output_token_ids(7)
    assert len(req.block_hashes) == 2, (
        f"11 tokens: still 2 full blocks, but the request now has {len(req.block_hashes)} "
        "hashes. The hasher returns only NEW hashes: those of whole blocks after the "
        "len(request.block_hashes) blocks already hashed."
    )
    req.append_output_token_ids(8)
    b2 = f(sha256, b1, prompt(1, 10)[8:] + [7, 8])
    assert req.block_hashes == [b0, b1, b2], (
        "12 tokens: the third block (2 prompt tokens and 2 sampled ones) is full and hashed, "
        "chained on the second block's hash (request.block_hashes[-1])."
    )


# --------------------------------------------------------- the cache itself


@pytest.mark.points(2)
def test_cache_full_blocks_registers_exactly_the_range(impl):
    mgr = manager(impl)
    pool = mgr.block_pool
    blocks = pool.get_new_blocks(4)
    req = types.SimpleNamespace(block_hashes=[h(1), h(2), h(3), h(4)])
    pool.cache_full_blocks(req, blocks, 1, 3)
    got = [b.block_hash for b in blocks]
    assert got == [None, cache_key(h(2)), cache_key(h(3)), None], (
        f"cache_full_blocks(request, blocks, num_cached_blocks=1, num_full_blocks=3) "
        f"registers blocks[1] and blocks[2] only, each under request.block_hashes[i] plus "
        f"the group id (make_block_hash_with_group_id). Got "
        f"block hashes {['h(%d)' % x[0] if x else None for x in got]}."
    )
    assert first_hit(pool, h(2)) is blocks[1] and first_hit(pool, h(1)) is None
    pool.cache_full_blocks(req, blocks, 3, 3)
    assert blocks[3].block_hash is None, "num_cached_blocks == num_full_blocks: nothing to do"


@pytest.mark.points(1)
def test_cache_full_blocks_never_caches_the_null_block(impl):
    mgr = manager(impl)
    pool = mgr.block_pool
    (blk,) = pool.get_new_blocks(1)
    req = types.SimpleNamespace(block_hashes=[h(1), h(2)])
    pool.cache_full_blocks(req, [pool.null_block, blk], 0, 2)
    assert pool.null_block.block_hash is None and first_hit(pool, h(1)) is None, (
        "The null block stands in for skipped blocks (sliding window upstream): it holds no "
        "KV, so it must never be registered in the prefix cache."
    )
    assert first_hit(pool, h(2)) is blk


@pytest.mark.points(2)
def test_duplicates_are_kept_and_the_oldest_is_found_first(impl):
    mgr = manager(impl)
    pool = mgr.block_pool
    x, y = pool.get_new_blocks(2)
    pool.cache_full_blocks(types.SimpleNamespace(block_hashes=[h(5)]), [x], 0, 1)
    pool.cache_full_blocks(types.SimpleNamespace(block_hashes=[h(5)]), [y], 0, 1)
    assert first_hit(pool, h(5)) is x, (
        "Two blocks carry h(5) (two requests computed the same prefix at the same time). "
        "Both stay registered (block tables are append-only, nothing is merged), and a lookup "
        "returns the one registered first."
    )
    assert x.block_hash == y.block_hash == cache_key(h(5))
    pool._maybe_evict_cached_block(x)
    assert first_hit(pool, h(5)) is y, (
        "After the first copy is evicted, the second one must still be found: register both "
        "under the key (the hash plus group id), keyed by block id "
        "(cached_block_hash_to_block[key][block_id])."
    )
    assert first_hit(pool, h(6)) is None, "A hash nobody registered is a miss: None."


# -------------------------------------------------------------- the lookup


@pytest.mark.points(2)
def test_the_hit_is_the_longest_prefix_and_stops_at_the_first_miss(impl):
    mgr = manager(impl)
    a = request(impl, "a", prompt(1, 13))
    run_whole(mgr, a)
    table = list(mgr.req_to_blocks["a"])
    b_tokens = prompt(1, 4) + prompt(2, 4) + prompt(1, 13)[8:]
    b = request(impl, "b", b_tokens)
    blocks, n = mgr.get_computed_blocks(b)
    assert (ids(blocks), n) == ([table[0].block_id], 4), (
        f"a (13 tokens) cached its 3 full blocks {[x.block_id for x in table[:3]]}. b shares "
        f"a's first block, differs in the second, and equals a's third block token for token. "
        f"Only the first block hits: the third block's hash chains a different second block, "
        f"so after the first miss nothing can hit. Expected ([{table[0].block_id}], 4), got "
        f"({ids(blocks)}, {n})."
    )
    c = request(impl, "c", prompt(1, 12) + [9, 9])
    blocks, n = mgr.get_computed_blocks(c)
    assert (ids(blocks), n) == ([x.block_id for x in table[:3]], 12), (
        f"c starts with a's 12 tokens: its 3 full blocks all hit a's blocks, covering 12 "
        f"tokens. Got ({ids(blocks)}, {n})."
    )


@pytest.mark.points(1)
def test_an_evicted_block_ends_the_hit_even_if_later_ones_are_cached(impl):
    mgr = manager(impl)
    a = request(impl, "a", prompt(1, 13))
    run_whole(mgr, a)
    table = list(mgr.req_to_blocks["a"])
    mgr.free(a)
    mgr.block_pool._maybe_evict_cached_block(table[1])  # as if reused by another request
    blocks, n = mgr.get_computed_blocks(request(impl, "b", prompt(1, 13)))
    assert (ids(blocks), n) == ([table[0].block_id], 4), (
        f"a's 3 full blocks {[x.block_id for x in table[:3]]} were cached, then the second "
        f"one was evicted (its KV is gone); the first and third are still in the cache. b has "
        f"a's tokens, but its hit must stop at the hole: only [{table[0].block_id}] (4 tokens). "
        f"The third block's KV was computed on top of the second block's and a hit must be a "
        f"contiguous prefix: stop at the first miss. Got ({ids(blocks)}, {n})."
    )


@pytest.mark.points(1)
@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_last_token_is_never_a_hit(impl, k):
    mgr = manager(impl)
    run_whole(mgr, request(impl, "a", prompt(1, 4 * k + 1)))
    exact = request(impl, "exact", prompt(1, 4 * k))
    _, n = mgr.get_computed_blocks(exact)
    assert n == 4 * (k - 1), (
        f"A prompt of exactly {k} full block(s), all cached: the model needs the logits of "
        f"its LAST token to sample the first output, so at most num_tokens - 1 = {4 * k - 1} "
        f"tokens may hit, which is {k - 1} whole block(s) = {4 * (k - 1)} tokens. Got {n}."
    )
    one_more = request(impl, "one_more", prompt(1, 4 * k + 1))
    _, n = mgr.get_computed_blocks(one_more)
    assert n == 4 * k, f"With one more token all {k} block(s) may hit: {4 * k} tokens; got {n}."


@pytest.mark.points(1)
def test_caching_off_never_hits(impl):
    mgr = manager(impl, caching=False)
    run_whole(mgr, request(impl, "a", prompt(1, 9)))
    blocks, n = mgr.get_computed_blocks(request(impl, "b", prompt(1, 9)))
    assert (ids(blocks), n) == ([], 0), (
        f"With enable_caching False there is no prefix cache: no hits. Got ({ids(blocks)}, {n})."
    )
    stats = mgr.prefix_cache_stats
    assert (stats.requests, stats.queries) == (0, 0), (
        "With caching off the lookup is skipped entirely, so it is not recorded in the stats "
        f"either (upstream returns before recording). Got requests={stats.requests}, "
        f"queries={stats.queries}."
    )


@pytest.mark.points(1)
def test_no_hit_returns_the_shared_empty_blocks(impl):
    mgr = manager(impl)
    blocks, n = mgr.get_computed_blocks(request(impl, "a", prompt(1, 9)))
    assert blocks is mgr.empty_kv_cache_blocks and n == 0, (
        "A miss returns (self.empty_kv_cache_blocks, 0): one shared, immutable empty result "
        "instead of a new object per lookup (upstream does the same to spare the garbage "
        f"collector). Got ({blocks!r}, {n})."
    )


@pytest.mark.points(1)
def test_every_lookup_is_recorded_in_the_stats(impl):
    mgr = manager(impl)
    run_whole(mgr, request(impl, "a", prompt(1, 9)))  # 9 queried, 0 hit
    b = request(impl, "b", prompt(1, 9))
    mgr.get_computed_blocks(b)  # 9 queried, 8 hit
    c = request(impl, "c", prompt(1, 9))
    c.num_preemptions = 1
    mgr.get_computed_blocks(c)  # a preempted request
    s = mgr.prefix_cache_stats
    got = (
        s.requests,
        s.queries,
        s.hits,
        s.preempted_requests,
        s.preempted_queries,
        s.preempted_hits,
    )
    assert got == (2, 18, 8, 1, 9, 8), (
        f"Three lookups of 9-token prompts: a (no hit), b (8 tokens hit), c (8 hit, but c was "
        f"preempted before, so it is counted apart). prefix_cache_stats.record(num_tokens, "
        f"num_hits, preempted=request.num_preemptions > 0) once per lookup. Expected (requests, "
        f"queries, hits, preempted requests, queries, hits) = (2, 18, 8, 1, 9, 8), got {got}."
    )


@pytest.mark.points(2)
def test_cache_blocks_caches_full_blocks_as_the_prefill_advances(impl):
    mgr = manager(impl)
    a = request(impl, "a", prompt(1, 10))
    mgr.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    table = mgr.req_to_blocks["a"]
    assert [b.block_hash is not None for b in table] == [True, False], (
        "After a chunk of 5 tokens (block size 4), block 0 is full and must be cached (the "
        "reference allocate_slots calls cache_blocks(request, 5)); block 1 holds 1 token and "
        f"must not be. Cached: {[b.block_hash is not None for b in table]}."
    )
    assert mgr.num_cached_block.get("a") == 1, (
        f"num_cached_block['a'] counts the request's leading cached blocks: 1, got "
        f"{mgr.num_cached_block.get('a')}."
    )
    mgr.allocate_slots(a, 5)
    a.num_computed_tokens = 10
    assert [b.block_hash is not None for b in table] == [
        True,
        True,
        False,
    ] and mgr.num_cached_block.get("a") == 2, (
        "After 10 tokens, blocks 0 and 1 are full and cached (block 0 only once: start "
        f"from num_cached_block). Cached: {[b.block_hash is not None for b in table]}, "
        f"num_cached_block {mgr.num_cached_block.get('a')}."
    )
    assert [b.block_hash for b in table[:2]] == [cache_key(x) for x in a.block_hashes[:2]]
    try:
        mgr.cache_blocks(a, 8)  # nothing new to register
    except AssertionError as e:
        pytest.fail(
            f"cache_blocks(a, 8) after 2 blocks were cached raised {e!r}: blocks "
            "already counted in num_cached_block must not be registered again.",
            pytrace=False,
        )


# -------------------------------------------------------------- properties


@pytest.fixture
def finished_lab(impl, monkeypatch):
    monkeypatch.setattr(hypothesis_engine, "MAX_SHRINKING_SECONDS", SHRINK_SECONDS)
    try:
        mgr = manager(impl)
        run_whole(mgr, request(impl, "a", prompt(1, 9)))
        mgr.get_computed_blocks(request(impl, "b", prompt(1, 9)))
    except NotImplementedError as e:
        pytest.fail(f"{e}: a lab region is not written yet.", pytrace=False)
    except Exception:  # noqa: BLE001 - a real bug: let the property find and shrink it
        pass
    return impl


TOKENS = st.lists(st.integers(1, 3), min_size=1, max_size=14)


@pytest.mark.timeout(60)
@pytest.mark.points(2)
@PROPERTY
@given(cached=st.lists(TOKENS, min_size=1, max_size=4), query=TOKENS)
def test_property_hits_are_the_longest_common_block_prefix(finished_lab, cached, query):
    """Prompts over 3 token values collide often. After the cached prompts
    have run, the query must hit exactly the longest run of whole blocks it
    shares with one of them (at most num_tokens - 1 tokens), and each hit
    block must hold the query's own tokens."""
    mgr = manager(finished_lab, num_blocks=64)
    tables = {}
    for i, tokens in enumerate(cached):
        r = request(finished_lab, f"c{i}", tokens)
        run_whole(mgr, r)
        tables[f"c{i}"] = (tokens, list(mgr.req_to_blocks[f"c{i}"]))
    q = request(finished_lab, "q", query)
    blocks, n = mgr.get_computed_blocks(q)
    limit = (len(query) - 1) // BS
    best = 0
    for tokens, _ in tables.values():
        k = 0
        while (
            k < limit
            and (k + 1) * BS <= len(tokens)
            and tokens[k * BS : (k + 1) * BS] == query[k * BS : (k + 1) * BS]
        ):
            k += 1
        best = max(best, k)
    where = f"cached prompts {cached}, query {query} (block size {BS})"
    assert n == best * BS and len(ids(blocks)) == best, (
        f"{where}: the query shares {best} whole leading block(s) with a cached prompt (and "
        f"may hit at most {limit}), so {best * BS} tokens must hit; got {n} tokens in blocks "
        f"{ids(blocks)}."
    )
    for j, blk in enumerate(blocks.blocks[0]):
        owners = [tokens for tokens, table in tables.values() if blk in table]
        assert any(tokens[: (j + 1) * BS] == query[: (j + 1) * BS] for tokens in owners), (
            f"{where}: hit block {j} (id {blk.block_id}) does not hold the query's tokens "
            f"{query[: (j + 1) * BS]} with the same prefix before them."
        )


@pytest.mark.timeout(60)
@pytest.mark.points(2)
@PROPERTY
@given(workload=kv_workloads(max_ops=40))
def test_property_same_trace_as_the_reference(finished_lab, workload):
    mismatch = kv_checks.reference_mismatch(finished_lab, workload)
    assert mismatch is None, "Your KV cache and the reference differ:\n" + mismatch


@pytest.mark.points(1)
@pytest.mark.parametrize("scenario", ["prefix_sharing", "chunked_prefill", "duplicate_hashes"])
def test_snapshot(impl, scenario):
    mismatch = kv_checks.snapshot_mismatch(impl, scenario)
    assert mismatch is None, mismatch
