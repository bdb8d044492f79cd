"""The Phase 07 benchmark measures what it says (mini_vllm/benchmarks/prefix_caching.py).

- the two caches it compares are upstream's grouping of the same layers:
  six one-layer groups with the hybrid manager, one six-layer group without,
  at the same memory;
- a decoding request's window groups hold the spec's own bound
  (``max_admission_blocks_per_request`` for one new token) and its full
  group every block, so the "pages held" table counts what it claims;
- its ideal hit rate (computed from the workload alone) is what the
  scheduler reaches with a cache that never evicts, for both caches, so the
  hit rates it reports are on the scale it states;
- with the pin installed, its upstream check runs upstream's Scheduler on the
  same workload and finds the same hits and steps.
"""

from __future__ import annotations

import importlib.util

import pytest

from mini_vllm.benchmarks import prefix_caching as bench
from mini_vllm.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec, cdiv


def test_the_two_caches_are_the_grouping_of_the_same_layers():
    window, full = bench.kv_cache_config(True, 6144), bench.kv_cache_config(False, 6144)
    kinds = [type(g.kv_cache_spec) for g in window.kv_cache_groups]
    assert kinds == [SlidingWindowSpec] * 5 + [FullAttentionSpec], (
        f"with the hybrid manager, expected five window groups and one full group, got {kinds}"
    )
    assert [len(g.layer_names) for g in window.kv_cache_groups] == [1] * 6
    (group,) = full.kv_cache_groups
    assert len(group.layer_names) == 6 and group.kv_cache_spec.sliding_window == bench.WINDOW, (
        "without the hybrid manager, all six layers must be one full-attention group that "
        "records the window"
    )
    # Same memory: 6144 pages are 6144 one-page blocks or 1024 six-page blocks.
    assert window.num_blocks * bench.pages_per_block(window) == 6144
    assert full.num_blocks * bench.pages_per_block(full) == 6144


def test_a_decoding_request_holds_the_windows_bound_and_every_full_block():
    prompt_len = 4096
    win = bench.one_request(prompt_len, window=True)
    spec = SlidingWindowSpec(sliding_window=bench.WINDOW, **bench.PAGE)
    bound = spec.max_admission_blocks_per_request(1, prompt_len + 128)
    *window_groups, full_group = win["final_blocks_per_group"]
    assert window_groups == [bound] * 5, (
        f"at the last step each window group must hold {bound} blocks (the window's last "
        f"{bench.WINDOW - 1} tokens, the new one, and one for a window that starts mid-block), "
        f"got {window_groups}"
    )
    # The last step is recorded before its token is appended: prompt + 127 tokens.
    assert full_group == cdiv(prompt_len + 127, bench.BLOCK_SIZE), (
        f"the full group must hold every block of the request, got {full_group}"
    )
    nowin = bench.one_request(prompt_len, window=False)
    assert nowin["final_pages"] == 6 * full_group, "without the window all six layers hold them"


@pytest.mark.parametrize("window", [False, True], ids=["no-window", "window"])
def test_a_cache_that_never_evicts_reaches_the_ideal_hit_rate(window):
    work = bench.shared_prompt_workload(60)
    got = bench.hit_rate(work, window, num_pages=98304)
    assert got["hit_rate"] == round(bench.ideal_hit_rate(work), 4), (
        f"with room for everything, every request after the first of its system prompt must hit "
        f"the prompt's whole blocks: ideal {bench.ideal_hit_rate(work):.4f}, got {got['hit_rate']}"
    )
    assert got["preemptions"] == 0


@pytest.mark.upstream
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the pinned upstream")
@pytest.mark.parametrize("window", [False, True], ids=["no-window", "window"])
def test_the_upstream_check_runs_upstreams_scheduler_to_the_same_hits(window):
    work = bench.shared_prompt_workload(80)
    ours = bench.hit_rate(work, window, 3072)
    theirs = bench.hit_rate(work, window, 3072, upstream=True)
    keys = ("hit_tokens", "lookup_hits", "lookup_queries", "steps", "preemptions")
    assert {k: theirs[k] for k in keys} == {k: ours[k] for k in keys}
    assert ours["hit_rate"] < bench.ideal_hit_rate(work), "3072 pages must evict something"
