"""Lab 07.3 — group-aware block hashing and eviction.

Graded: the ``LAB 07.3`` regions of ``labs/phase_07/kv_cache_utils.py``
(``make_block_hash_with_group_id``, ``get_block_hash``, ``get_group_id``:
the prefix cache's key, a block hash with its group id appended) and of
``labs/phase_07/single_type_kv_cache_manager.py`` (``cache_blocks``: a
group registers its full blocks under its own keys; ``free``: a group gives
its blocks back tail first). The other Phase 07 regions hold the
reference's code.

Upstream's prefix cache maps a key (hash + group id) to blocks, so the same
tokens cached by two groups are two entries, and reusing a block evicts
only its own group's entry. The checks run the pinned upstream beside your
code: the key bytes against upstream's helpers; a scenario in which one
group's entry is evicted and the other's stays; then generated workloads in
lockstep, the prefix cache's keys ((group id, block hash) -> block ids)
compared after every operation with everything else the KV cache holds.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from phase07_helpers import hybrid_workloads, upstream_mismatch, written

from mini_vllm.grading.checks import lab_settings
from mini_vllm.oracle.kv_workload import KVWorkload, run_kv_workload

pytestmark = [pytest.mark.upstream, pytest.mark.timeout(300)]

PROPERTY = lab_settings(200)
LOCKSTEP = lab_settings(300)


@pytest.mark.points(3)
@PROPERTY
@example(block_hash=bytes(32), group_id=0)
@example(block_hash=b"\x01" * 32, group_id=1)
@example(block_hash=b"\xff" * 32, group_id=2**32 - 1)
@given(block_hash=st.binary(min_size=1, max_size=40), group_id=st.integers(0, 2**32 - 1))
def test_keys_equal_upstreams(impl, block_hash, group_id):
    from vllm.v1.core import kv_cache_utils as theirs

    utils = impl.kv_cache_utils
    want = theirs.make_block_hash_with_group_id(block_hash, group_id)
    got = written(utils.make_block_hash_with_group_id, block_hash, group_id)
    assert bytes(got) == bytes(want), (
        f"make_block_hash_with_group_id(hash {block_hash.hex()[:16]}..., group {group_id}): "
        f"yours ends {bytes(got)[-6:].hex()}, upstream's {bytes(want)[-6:].hex()} (last 6 "
        f"bytes; lengths {len(got)} and {len(want)}). The key is the hash's bytes followed "
        "by the group id as 4 unsigned big-endian bytes, one bytes object."
    )
    for name in ("get_block_hash", "get_group_id"):
        expected = getattr(theirs, name)(want)
        value = written(getattr(utils, name), want)
        assert value == expected, (
            f"{name} of upstream's key for (hash {block_hash.hex()[:16]}..., group "
            f"{group_id}): yours {value!r}, upstream's {expected!r}. It reads back what "
            "make_block_hash_with_group_id packed: the hash is all but the last 4 bytes, "
            "the group id those 4, big-endian."
        )


# Full attention and a window wider than every prompt, so both groups cache the
# same hashes. r0's blocks are cached in both groups and freed (group 0's tail
# first, then group 1's); r1 then needs every fresh block and one more, the
# block holding r0's last block in group 0: its key in group 0 is evicted, the
# same hash's key in group 1 stays; r2 repeats r0's prompt and looks it up.
ONE_KEY_EVICTED = KVWorkload(
    name="one group's key evicted",
    config={
        "block_size": 2,
        "num_blocks": 12,
        "max_model_len": 32,
        "enable_caching": True,
        "groups": [None, 64],
    },
    requests=[
        ["r0", [1, 2, 3, 4, 5, 6]],
        ["r1", [7, 8, 9, 10, 11, 12]],
        ["r2", [1, 2, 3, 4, 5, 6, 13]],
    ],
    ops=[
        ["lookup", "r0"],
        ["allocate", "r0", 6],
        ["free", "r0"],
        ["lookup", "r1"],
        ["allocate", "r1", 6],
        ["free", "r1"],
        ["lookup", "r2"],
        ["allocate", "r2", 3],
    ],
)


@pytest.mark.points(4)
def test_reusing_a_block_evicts_its_own_groups_key_only(impl, up):
    trace = run_kv_workload(up, ONE_KEY_EVICTED)["ops"]
    keys = [{(k[0], k[1]) for k in r["cached_keys"]} for r in trace]
    evicted = keys[2] - keys[4]
    assert len(evicted) == 1 and {(1 - g, h) for g, h in evicted} <= keys[4], (
        "the scenario no longer evicts one group's key only on upstream: update it"
    )
    message = upstream_mismatch(impl, up, ONE_KEY_EVICTED)
    assert message is None, (
        f"{message}\nIn this scenario both groups cache r0's three blocks under the same "
        "three hashes, as six keys (hash + group id). Reusing one block evicts that block's "
        "own key; the other group's key for the same hash stays, and r2's lookup still hits "
        "it there."
    )


@pytest.mark.points(8)
@LOCKSTEP
@given(workload=hybrid_workloads)
def test_group_keys_in_lockstep_with_upstream(impl, up, workload):
    message = upstream_mismatch(impl, up, workload)
    assert message is None, message
