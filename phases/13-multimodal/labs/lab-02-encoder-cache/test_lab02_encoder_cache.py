"""Lab 13.2 — the encoder cache.

Graded: the ``LAB 13.2`` regions of ``labs/phase_13/encoder_cache_manager.py``:
``EncoderCacheManager.check_and_update_cache`` (a hit takes a reference; an
unreferenced entry stops being freeable), ``can_allocate`` (the compute
budget, then free slots, then free plus freeable slots, evicting the oldest
unreferenced entries), ``allocate``, ``free_encoder_input`` (the last
reference gone: the entry becomes freeable, not freed) and
``get_freed_mm_hashes`` (the evicted hashes, reported once).

Against upstream's class (vllm/v1/core/encoder_cache_manager.py:17), live:

1. small call sequences, one rule each, on your manager and upstream's side
   by side: after every call both return the same and hold the same
   bookkeeping (free and freeable slots, which requests reference which
   entry, the unreferenced entries oldest first);
2. generated call sequences (the calls the scheduler makes, in any order);
3. the reference Scheduler running on your EncoderCacheManager, in
   lockstep with upstream's scheduler on generated multimodal workloads.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from phase13_helpers import lockstep

import mini_vllm.testing as mini
from mini_vllm.grading.checks import lab_settings, written
from mini_vllm.oracle.strategies import mm_workloads
from mini_vllm.oracle.workload import encoder_cache_state

pytestmark = pytest.mark.upstream

# Images: identifier -> (placeholder length, is_embed mask). An identifier
# always has the same embeddings, as one image does.
IMAGES = {
    "a": (4, None),
    "b": (6, [True, False, True, True, False, True]),  # 4 embeddings
    "c": (3, None),
    "d": (8, None),
    "e": (5, [False, True, True, True, True]),  # 4 embeddings
}
# Requests: id -> the images in its prompt, in order.
REQUESTS = {"r0": "ab", "r1": "bc", "r2": "ad", "r3": "ec", "r4": "de"}

WORDS = {
    "check": "check_and_update_cache({r}, {i})",
    "can": (
        "can_allocate({r}, {i}, encoder_compute_budget={budget}, num_embeds_to_schedule={pending})"
    ),
    "alloc": "allocate({r}, {i})",
    "free_one": "free_encoder_input({r}, {i})",
    "free": "free({r})",
    "freed": "get_freed_mm_hashes()",
}


def make_requests(backend) -> dict:
    out = {}
    for rid, idents in REQUESTS.items():
        items, offset = [], 1
        for ident in idents:
            length, mask = IMAGES[ident]
            items.append([offset, length, ident, mask])
            offset += length + 1
        (out[rid],) = backend.create_requests(
            1, req_ids=[rid], prompt_token_ids=[[5] * (offset + 1)], mm_items=[items]
        )
    return out


class SideBySide:
    """Your EncoderCacheManager and upstream's, fed the same calls."""

    def __init__(self, impl, up, cache_size: int) -> None:
        from vllm.v1.core.encoder_cache_manager import EncoderCacheManager as Upstream

        self.ours = impl.encoder_cache_manager.EncoderCacheManager(cache_size)
        self.theirs = Upstream(cache_size)
        self.mine_reqs, self.up_reqs = make_requests(mini), make_requests(up)
        self.calls: list[str] = [f"EncoderCacheManager(cache_size={cache_size})"]

    def state(self, manager, req) -> list:
        return [*encoder_cache_state(manager), sorted(manager.get_cached_input_ids(req))]

    def call(self, op: str, r: str = "r0", i: int = 0, budget: int = 0, pending: int = 0):
        a, b = self.mine_reqs[r], self.up_reqs[r]
        args = {
            "check": (a, i),
            "can": (a, i, budget, pending),
            "alloc": (a, i),
            "free_one": (a, i),
            "free": (a,),
            "freed": (),
        }[op]
        names = {
            "check": "check_and_update_cache",
            "can": "can_allocate",
            "alloc": "allocate",
            "free_one": "free_encoder_input",
            "free": "free",
            "freed": "get_freed_mm_hashes",
        }
        self.calls.append(WORDS[op].format(r=r, i=i, budget=budget, pending=pending))
        up_args = tuple(b if x is a else x for x in args)
        want = getattr(self.theirs, names[op])(*up_args)
        try:
            got = written(getattr(self.ours, names[op]), *args)
        except (AssertionError, KeyError, ValueError, TypeError, AttributeError) as e:
            pytest.fail(
                f"your {self.calls[-1]} raised {type(e).__name__}: {e}; upstream's returned "
                f"{want!r}.\n{self.history()}",
                pytrace=False,
            )
        assert got == want, (
            f"{self.calls[-1]} returned {got!r}, upstream's {want!r}.\n{self.history()}"
        )
        mine, theirs = self.state(self.ours, a), self.state(self.theirs, b)
        assert mine == theirs, (
            f"after {self.calls[-1]} the bookkeeping differs.\n"
            f"  upstream: {theirs}\n  yours:    {mine}\n"
            "(free slots, freeable slots, [identifier, requests referencing it] sorted, the "
            f"unreferenced identifiers oldest first, get_cached_input_ids({r}))\n{self.history()}"
        )
        return got

    def history(self) -> str:
        requests = ", ".join(f"{r} has images {list(v)}" for r, v in REQUESTS.items())
        return (
            "Calls so far, on a fresh manager: " + "; ".join(self.calls) + f"\n({requests}; "
            f"image sizes in embeddings: a 4, b 4 (6 placeholders, a mask), c 3, d 8, e 4)"
        )


# ------------------------------------------------------------------ the rules


@pytest.mark.points(3)
def test_allocate_then_a_hit_shares_the_entry(impl, up):
    s = SideBySide(impl, up, 12)
    s.call("check", "r0", 0)  # a: not cached
    s.call("can", "r0", 0, budget=8)
    s.call("alloc", "r0", 0)
    s.call("check", "r2", 0)  # r2's image 0 is a too: a hit, a second reference
    s.call("check", "r0", 1)


@pytest.mark.points(3)
def test_the_last_reference_makes_an_entry_freeable_not_free(impl, up):
    s = SideBySide(impl, up, 12)
    s.call("alloc", "r0", 0)
    s.call("alloc", "r0", 1)
    s.call("check", "r2", 0)
    s.call("free_one", "r0", 0)  # r2 still holds a
    s.call("free_one", "r2", 0)  # now nobody: freeable, still cached
    s.call("free", "r0")  # b too
    s.call("check", "r2", 0)  # a hit on a freeable entry takes it back
    s.call("freed")


@pytest.mark.points(4)
def test_can_allocate_checks_budget_then_space_and_evicts_oldest_first(impl, up):
    s = SideBySide(impl, up, 12)
    s.call("can", "r0", 0, budget=3)  # a has 4 embeddings: over the compute budget
    s.call("alloc", "r0", 0)  # a: 4
    s.call("alloc", "r1", 1)  # c: 3
    s.call("alloc", "r0", 1)  # b: 4 -> 1 free slot left
    s.call("free_one", "r0", 0)  # a freeable (oldest)
    s.call("free_one", "r1", 1)  # c freeable
    s.call("can", "r2", 1, budget=8, pending=6)  # d (8) + 6 promised > 1 free + 7 freeable
    s.call("freed")  # a refusal evicts nothing
    s.call("can", "r2", 1, budget=8)  # d (8): evicts a, then c
    s.call("freed")
    s.call("freed")  # reported once


@pytest.mark.points(3)
def test_masked_images_count_embeddings_not_placeholders(impl, up):
    s = SideBySide(impl, up, 8)
    s.call("alloc", "r0", 1)  # b: 6 placeholders, 4 embeddings
    s.call("can", "r3", 0, budget=4)  # e: 5 placeholders, 4 embeddings: fits exactly
    s.call("alloc", "r3", 0)
    s.call("can", "r1", 1, budget=8)  # c: no room, nothing freeable


# ------------------------------------------------------------------ generated


OPS = st.sampled_from(["check", "can", "can", "alloc", "free_one", "free", "freed"])


@pytest.mark.points(6)
@pytest.mark.timeout(300)
def test_generated_call_sequences_match_upstream(impl, up):
    @lab_settings(40, shrink=True)
    @given(
        cache_size=st.sampled_from([8, 12, 20]),
        calls=st.lists(
            st.tuples(
                OPS,
                st.sampled_from(sorted(REQUESTS)),
                st.integers(0, 1),
                st.integers(0, 10),
                st.integers(0, 6),
            ),
            max_size=60,
        ),
    )
    def run(cache_size, calls):
        s = SideBySide(impl, up, cache_size)
        for op, r, i, budget, pending in calls:
            if op == "alloc":
                # As the scheduler does: allocate only what is not cached and
                # what can_allocate (called on both sides) accepts.
                if REQUESTS[r][i] in s.theirs.cached or not s.call("can", r, i, budget=99):
                    continue
            s.call(op, r, i, budget=budget, pending=pending)

    run()


@pytest.mark.points(6)
@pytest.mark.timeout(300)
def test_the_reference_scheduler_on_your_cache_matches_upstream(impl, up):
    @lab_settings(20)
    @given(w=mm_workloads())
    def run(w):
        sched = mini.create_scheduler(**w.config)
        sched.encoder_cache_manager = impl.encoder_cache_manager.EncoderCacheManager(
            sched.encoder_cache_manager.cache_size
        )
        lockstep(up, w, sched, who="the reference Scheduler on your EncoderCacheManager")

    run()
