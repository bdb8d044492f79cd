"""Live lockstep: mini_vllm's decode-first reorder
(mini_vllm/attention/backends/utils.py) against the pinned upstream's
``reorder_batch_to_split_decodes_and_prefills``, which runs on CPU arrays.

Hypothesis draws batches of rows (prompt length, tokens computed, tokens
scheduled) and a decode threshold; both functions reorder their own copy of
the batch, and must return the same answer, make the same swaps in the same
order, and leave the same row order. Swaps are recorded by a stand-in batch
that has only what the function reads.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_vllm.attention.backends.utils import reorder_batch_to_split_decodes_and_prefills

pytestmark = pytest.mark.upstream


class _RecordingBatch:
    def __init__(self, rows: list[tuple[int, int]]) -> None:
        self.req_ids = [f"r{i}" for i in range(len(rows))]
        self.num_prompt_tokens = np.array([p for p, _ in rows], dtype=np.int32)
        self.num_computed_tokens_cpu = np.array([c for _, c in rows], dtype=np.int32)
        self.swaps: list[tuple[int, int]] = []

    def swap_states(self, i1: int, i2: int) -> None:
        self.swaps.append((i1, i2))
        ids = self.req_ids
        ids[i1], ids[i2] = ids[i2], ids[i1]
        for array in (self.num_prompt_tokens, self.num_computed_tokens_cpu):
            array[[i1, i2]] = array[[i2, i1]]


@st.composite
def _batches(draw):
    rows, scheduled = [], []
    for _ in range(draw(st.integers(0, 12))):
        prompt = draw(st.integers(1, 40))
        computed = draw(st.sampled_from([0, prompt]) | st.integers(0, prompt + 10))
        rows.append((prompt, computed))
        scheduled.append(draw(st.sampled_from([1, 1, 2]) | st.integers(1, 30)))
    return rows, scheduled


@settings(max_examples=300, deadline=None, derandomize=True)
@given(batch=_batches(), threshold=st.sampled_from([1, 1, 2, 4]))
def test_reorder_matches_upstream(batch, threshold):
    from vllm.v1.attention.backends.utils import (
        reorder_batch_to_split_decodes_and_prefills as upstream_reorder,
    )

    rows, scheduled = batch
    so = SimpleNamespace(num_scheduled_tokens={f"r{i}": n for i, n in enumerate(scheduled)})
    want, got = _RecordingBatch(rows), _RecordingBatch(rows)
    want_moved = upstream_reorder(want, so, decode_threshold=threshold)
    got_moved = reorder_batch_to_split_decodes_and_prefills(got, so, decode_threshold=threshold)
    assert (got_moved, got.swaps, got.req_ids) == (want_moved, want.swaps, want.req_ids), (
        rows,
        scheduled,
        threshold,
    )
