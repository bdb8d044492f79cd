"""The plugin that runs upstream's unit tests on a student's starters reaches
the student's code, even through a reference function the starter re-exports.

Needs neither the pinned vllm nor upstream's tests: it builds the adapter
upstream's test_sampler.py gets for ``Sampler`` and calls it directly.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from mini_vllm.oracle.upstream_suite import plugin


@pytest.fixture
def untouched_phase_06(tmp_path, monkeypatch):
    labs = tmp_path / "labs"
    subprocess.run(
        [sys.executable, "-m", "mini_vllm.grading", "generate", "--out", str(labs)],
        check=True,
        capture_output=True,
    )
    monkeypatch.setenv("MINI_VLLM_LABS_DIR", str(labs))
    plugin._load_labs("06")
    plugin.adapter.cache_clear()
    yield
    plugin.LAB_MODULES.clear()
    plugin.adapter.cache_clear()


def test_upstream_apply_penalties_runs_the_students_penalties(untouched_phase_06):
    # The starter re-exports the reference's apply_all_penalties, which must
    # call the starter's apply_penalties (Lab 06.1), not the reference's.
    sampler = plugin.adapter("vllm.v1.sample.sampler", "Sampler")()
    metadata = SimpleNamespace(
        no_penalties=False,
        prompt_token_ids=torch.zeros((1, 1), dtype=torch.int64),
        presence_penalties=torch.ones(1),
        frequency_penalties=torch.zeros(1),
        repetition_penalties=torch.ones(1),
    )
    with pytest.raises(NotImplementedError, match="Lab 06.1"):
        sampler.apply_penalties(torch.zeros((1, 8)), metadata, [[1]])


@pytest.fixture
def untouched_phase_07(tmp_path, monkeypatch):
    from mini_vllm.core import block_pool

    labs = tmp_path / "labs"
    subprocess.run(
        [sys.executable, "-m", "mini_vllm.grading", "generate", "--out", str(labs)],
        check=True,
        capture_output=True,
    )
    monkeypatch.setenv("MINI_VLLM_LABS_DIR", str(labs))
    # _load_labs points the reference pool at the student's keys: undone after.
    monkeypatch.setattr(
        block_pool, "make_block_hash_with_group_id", block_pool.make_block_hash_with_group_id
    )
    plugin._load_labs("07")
    plugin.adapter.cache_clear()
    yield
    plugin.LAB_MODULES.clear()
    plugin.HYBRID_LABS = None
    plugin.adapter.cache_clear()


def test_phase_07_tests_reach_the_students_managers_coordinator_and_keys(untouched_phase_07):
    from mini_vllm.core import block_pool
    from mini_vllm.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from mini_vllm.kv_cache_interface import SlidingWindowSpec as Window

    spec = Window(block_size=2, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=4)
    pool = plugin.adapter("vllm.v1.core.block_pool", "BlockPool")(10, True, hash_block_size=2)
    manager_cls = plugin.adapter(
        "vllm.v1.core.single_type_kv_cache_manager", "SlidingWindowManager"
    )
    manager = manager_cls(spec, block_pool=pool, enable_caching=True, kv_cache_group_id=0)
    with pytest.raises(NotImplementedError, match="Lab 07.1"):
        manager.get_num_skipped_tokens(5)
    # Re-opened on the base class, which the student's SlidingWindowManager
    # does not inherit from: it must be there all the same.
    with pytest.raises(NotImplementedError, match="Lab 07.1"):
        manager.remove_skipped_blocks("r", 5)
    with pytest.raises(NotImplementedError, match="Lab 07.1"):
        manager_cls.find_longest_cache_hit([], 0, [0], pool, spec)
    with pytest.raises(NotImplementedError, match="Lab 07.3"):
        block_pool.make_block_hash_with_group_id(b"h", 0)
    full = FullAttentionSpec(block_size=2, num_kv_heads=1, head_size=1, dtype=torch.float32)
    config = KVCacheConfig(10, [], [KVCacheGroupSpec(["a"], full), KVCacheGroupSpec(["b"], spec)])
    kv_manager = plugin.adapter("vllm.v1.core.kv_cache_manager", "KVCacheManager")(
        config, max_model_len=64, hash_block_size=2
    )
    with pytest.raises(NotImplementedError, match="Lab 07.2"):
        kv_manager.coordinator.find_longest_cache_hit([], 4)
