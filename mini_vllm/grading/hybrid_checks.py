"""Checks the Phase 07 graded suites share: a student's KV-cache groups run
in lockstep with the pinned upstream's coordinator, operation for operation.

The starters re-open only the methods that hold a lab, and the reference
builds its coordinator and managers by name from its own modules. So the
wiring below puts the student's pieces where the reference would put its own:

- ``manager_classes``: the student's ``FullAttentionManager`` and
  ``SlidingWindowManager``, each also given the methods the starter re-opens
  on ``SingleTypeKVCacheManager`` (``remove_skipped_blocks``, ``cache_blocks``,
  ``free``: upstream defines them on the base class, which both inherit);
- ``your_coordinator``: ``get_kv_cache_coordinator``'s choice (no prefix
  caching, one group, several) made with the student's coordinator classes,
  holding managers of those classes;
- ``your_keys``: while it is open, the reference ``BlockPool`` keys its prefix
  cache with the student's ``make_block_hash_with_group_id``.

A trace records, after every operation, what Phase 02's KV traces record
(``mini_vllm.oracle.kv_workload``: returned blocks per group, free queue,
reference counts, cached blocks, block tables per group, hits) and the prefix
cache's keys: (group id, block hash) -> cached block ids, read back with
upstream's own ``get_group_id`` and ``get_block_hash``.
"""

from __future__ import annotations

import contextlib
import traceback

import mini_vllm.testing as mini
from mini_vllm.core import block_pool as ref_block_pool
from mini_vllm.core import kv_cache_coordinator as ref_coordinator
from mini_vllm.core import kv_cache_utils as ref_utils
from mini_vllm.core import single_type_kv_cache_manager as ref_managers
from mini_vllm.core.kv_cache_manager import KVCacheManager
from mini_vllm.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from mini_vllm.oracle.kv_workload import KVWorkload, describe_op, first_kv_difference

YOURS = "your KV-cache groups"


def manager_classes(impl) -> dict[type, type]:
    """{spec class: the student's manager class for it}."""
    module = impl.single_type_kv_cache_manager
    base = module.SingleTypeKVCacheManager
    reopened = {}
    if base is not ref_managers.SingleTypeKVCacheManager:
        reopened = {k: v for k, v in vars(base).items() if callable(v) and not k.startswith("__")}
    return {
        FullAttentionSpec: type("FullAttentionManager", (module.FullAttentionManager,), reopened),
        SlidingWindowSpec: type("SlidingWindowManager", (module.SlidingWindowManager,), reopened),
    }


def your_coordinator(
    impl, kv_cache_config, max_model_len: int, max_num_batched_tokens: int, enable_caching: bool
):
    """``get_kv_cache_coordinator`` with the student's coordinator and manager classes."""
    module = impl.kv_cache_coordinator
    if not enable_caching:
        coordinator = module.KVCacheCoordinatorNoPrefixCache(
            kv_cache_config, max_model_len, max_num_batched_tokens
        )
    elif len(kv_cache_config.kv_cache_groups) == 1:
        coordinator = module.UnitaryKVCacheCoordinator(
            kv_cache_config, max_model_len, max_num_batched_tokens, enable_caching
        )
    else:
        coordinator = module.HybridKVCacheCoordinator(
            kv_cache_config, max_model_len, max_num_batched_tokens, enable_caching
        )
    classes = manager_classes(impl)
    coordinator.single_type_managers = tuple(
        classes[type(m.kv_cache_spec)](
            m.kv_cache_spec,
            block_pool=coordinator.block_pool,
            enable_caching=m.enable_caching,
            kv_cache_group_id=m.kv_cache_group_id,
            max_admission_blocks_per_request=m._max_admission_blocks_per_request,
        )
        for m in coordinator.single_type_managers
    )
    if isinstance(coordinator, ref_coordinator.HybridKVCacheCoordinator):
        coordinator.verify_and_split_kv_cache_groups()  # records the manager classes
    return coordinator


@contextlib.contextmanager
def your_keys(impl):
    """The reference BlockPool keys its prefix cache with the student's
    ``make_block_hash_with_group_id`` until the block ends."""
    saved = ref_block_pool.make_block_hash_with_group_id
    ref_block_pool.make_block_hash_with_group_id = impl.kv_cache_utils.make_block_hash_with_group_id
    try:
        yield
    finally:
        ref_block_pool.make_block_hash_with_group_id = saved


def cached_keys(cache: dict, get_group_id, get_block_hash) -> list:
    """[group id, block hash (hex), cached block ids], sorted, from a block
    pool's key -> block(s) map (upstream's holds a bare block or a dict)."""
    out = []
    for key, blocks in cache.items():
        ids = sorted(blocks) if isinstance(blocks, dict) else [blocks.block_id]
        out.append([get_group_id(key), bytes(get_block_hash(key)).hex(), ids])
    return sorted(out)


class Backend:
    """``run_kv_workload``'s backend for the modules under grade."""

    def __init__(self, impl) -> None:
        self.impl = impl
        self.create_requests = mini.create_requests

    def create_kv_cache_manager(
        self, block_size: int, num_blocks: int, max_model_len: int, enable_caching: bool, groups
    ):
        config = mini.kv_cache_config_of(num_blocks, block_size, groups)
        manager = KVCacheManager(
            num_blocks, block_size, max_model_len, enable_caching, kv_cache_config=config
        )
        assert manager.coordinator is not None, "Phase 07's workloads have window groups"
        manager.coordinator = your_coordinator(
            self.impl, config, max_model_len, max_model_len, enable_caching
        )
        manager.block_pool = manager.coordinator.block_pool
        return manager

    @staticmethod
    def manager_state(manager) -> dict:
        state = mini.manager_state(manager)
        cache = manager.block_pool.cached_block_hash_to_block
        state["cached_keys"] = cached_keys(cache, ref_utils.get_group_id, ref_utils.get_block_hash)
        return state


class UpstreamBackend:
    """The pinned upstream's KV-cache manager, its prefix cache's keys recorded too."""

    def __init__(self) -> None:
        from mini_vllm.oracle import upstream

        self.up = upstream
        self.create_kv_cache_manager = upstream.create_kv_cache_manager
        self.create_requests = upstream.create_requests

    def manager_state(self, manager) -> dict:
        from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id

        state = self.up.manager_state(manager)
        cache = manager.block_pool.cached_block_hash_to_block._cache
        state["cached_keys"] = cached_keys(cache, get_group_id, get_block_hash)
        return state


def _first_key_difference(expected: dict, got: dict) -> str | None:
    for i, (e, g) in enumerate(zip(expected["ops"], got["ops"], strict=False)):
        if e["cached_keys"] != g["cached_keys"]:
            want = {tuple(k[:2]): k[2] for k in e["cached_keys"]}
            have = {tuple(k[:2]): k[2] for k in g["cached_keys"]}
            lines = [
                f"  (group {gid}, hash {h[:12]}...): upstream {want.get((gid, h))}, "
                f"yours {have.get((gid, h))}"
                for gid, h in sorted(want.keys() | have.keys())
                if want.get((gid, h)) != have.get((gid, h))
            ]
            return (
                f"operation {i}, {describe_op(e['op'])}: the prefix cache's keys differ "
                "((group id, block hash) -> cached block ids; None: no such key):\n"
                + "\n".join(lines[:8])
            )
    return None


def upstream_mismatch(impl, upstream: UpstreamBackend, workload: KVWorkload) -> str | None:
    """None if the KV-cache groups under grade and upstream's agree after every
    operation of ``workload``, else the first operation and field that differ."""
    from mini_vllm.oracle.kv_workload import run_kv_workload

    expected = run_kv_workload(upstream, workload)
    try:
        with your_keys(impl):
            got = run_kv_workload(Backend(impl), workload)
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001 - a bug in the code under grade, told in words
        where = traceback.extract_tb(e.__traceback__)[-1]
        return (
            f"{YOURS} raised {type(e).__name__}: {e} at `{where.line}` (line {where.lineno} "
            f"of {where.filename}).\nconfig: {workload.config}\nrequests: {workload.requests}\n"
            f"operations: {workload.ops}"
        )
    diff = first_kv_difference(expected, got, labels=("upstream", YOURS))
    diff = diff or _first_key_difference(expected, got)
    if diff is None:
        return None
    groups = ", ".join(
        "full attention" if w is None else f"window {w}" for w in workload.config["groups"]
    )
    return (
        f"{diff}\nKV-cache groups: {groups} (group ids in this order); config: "
        f"{workload.config}\nrequests (id, prompt): {workload.requests}\noperations: "
        f"{workload.ops}"
    )
