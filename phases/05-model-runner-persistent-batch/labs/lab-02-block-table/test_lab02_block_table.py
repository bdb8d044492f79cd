"""Lab 05.2 — the block table: rows that follow their requests, and the slot mapping.

Graded: the ``LAB 05.2`` regions of ``labs/phase_05/block_table.py``
(``BlockTable.append_row``, ``move_row``, ``swap_row`` and
``compute_slot_mapping``).

First the rules on small tables (appending after the blocks a row holds,
copying and exchanging rows whole, the slot arithmetic, padding with -1, and
reading only the committed device table), then random tables and positions
against the reference, then against the pinned upstream's ``BlockTable``:
its row edits, and its Triton slot-mapping kernel (run by Triton's
interpreter on a CPU, TRITON_INTERPRET=1).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mini_vllm.grading.checks import lab_settings
from mini_vllm.worker.block_table import PAD_SLOT_ID
from mini_vllm.worker.block_table import BlockTable as ReferenceBlockTable

from phase05_helpers import written

PROPERTY = lab_settings(30, shrink=True)
CPU = torch.device("cpu")


def table(cls, block_size=4, max_num_reqs=3, max_blocks=6, max_tokens=8):
    return cls(block_size, max_num_reqs, max_blocks, max_tokens, False, CPU)


def upstream_table(block_size, max_num_reqs, max_blocks, max_tokens):
    from mini_vllm.oracle.batch_workload import UPSTREAM_DEVICE, upstream_block_table_module

    cls = upstream_block_table_module().BlockTable
    # kernel_block_size = block_size (no splitting), no context parallelism.
    return cls(
        block_size, max_num_reqs, max_blocks, max_tokens, False, UPSTREAM_DEVICE, block_size, 1
    )


def row_blocks(t, row) -> list[int]:
    return t.block_table.np[row, : int(t.num_blocks_per_row[row])].tolist()


def state(t) -> list[list[int]]:
    return [row_blocks(t, r) for r in range(t.num_blocks_per_row.shape[0])]


def slots(t, num_reqs, qsl, positions) -> list[int]:
    """Commit the table, then the slot mapping of ``positions`` (all of it, padding included)."""
    t.commit_block_table(num_reqs)
    device = t.block_table.gpu.device
    written(
        t.compute_slot_mapping,
        num_reqs,
        torch.tensor(qsl, dtype=torch.int32, device=device),
        torch.tensor(positions, dtype=torch.int64, device=device),
    )
    return t.slot_mapping.gpu.tolist()


# ------------------------------------------------------------ rows


@pytest.mark.points(3)
def test_append_row_adds_after_the_blocks_a_row_holds(impl):
    t = table(impl.block_table.BlockTable)
    t.block_table.np[:] = 99  # stale ids from earlier requests: never read
    written(t.add_row, [7, 9], 0)  # add_row = forget the row, then append_row
    written(t.append_row, [11], 0)
    written(t.append_row, [], 0)
    written(t.append_row, [3, 4], 2)
    got = (state(t), t.num_blocks_per_row.tolist())
    want = ([[7, 9, 11], [], [3, 4]], [3, 0, 2])
    assert got == want, (
        "append_row writes the new block ids right after the num_blocks_per_row[row] ids the "
        "row already holds, and adds their number to num_blocks_per_row[row]; an empty list "
        f"changes nothing. After add_row([7, 9], 0), append_row([11], 0), append_row([], 0), "
        f"append_row([3, 4], 2): expected (rows, counts) {want}, got {got}."
    )


@pytest.mark.points(2)
def test_move_row_copies_blocks_and_count(impl):
    t = table(impl.block_table.BlockTable)
    written(t.add_row, [1, 2, 3, 4], 0)  # longer than what moves in: its tail is stale
    written(t.add_row, [5, 6], 2)
    written(t.move_row, 2, 0)
    got = state(t)
    assert got[0] == [5, 6] and t.num_blocks_per_row[0] == 2, (
        "move_row(src=2, tgt=0) copies row 2's blocks in use AND its count into row 0 "
        f"(condense moves a request down into a hole): row 0 should read [5, 6], got {got[0]} "
        f"(count {t.num_blocks_per_row[0]})."
    )
    assert got[2] == [5, 6], f"move_row leaves the source row as it was; row 2 is now {got[2]}."


@pytest.mark.points(3)
def test_swap_row_exchanges_blocks_and_counts(impl):
    t = table(impl.block_table.BlockTable)
    written(t.add_row, [1, 2, 3], 0)
    written(t.add_row, [8], 1)
    written(t.swap_row, 0, 1)
    got = (state(t)[:2], t.num_blocks_per_row[:2].tolist())
    want = ([[8], [1, 2, 3]], [1, 3])
    assert got == want, (
        "swap_row exchanges two rows whole, blocks and counts. Rows [1, 2, 3] and [8] swapped "
        f"should give (rows, counts) {want}; got {got}. In numpy a[i], a[j] = a[j], a[i] "
        "copies a[j] into a[i] through a view before a[j] reads it; a[[i, j]] = a[[j, i]] "
        "does not."
    )


# ------------------------------------------------------------ slot mapping


@pytest.mark.points(3)
def test_slot_is_block_id_times_block_size_plus_offset(impl):
    t = table(impl.block_table.BlockTable, block_size=4, max_tokens=8)
    written(t.add_row, [7, 9], 0)
    written(t.add_row, [3], 1)
    written(t.add_row, [5, 2], 2)
    # Row 0: positions 0, 5, 6; row 1: position 2; row 2: positions 4, 7.
    got = slots(t, 3, [0, 3, 4, 6], [0, 5, 6, 2, 4, 7])
    want = ReferenceBlockTable(4, 3, 6, 8, False, CPU)
    for row, ids in enumerate(([7, 9], [3], [5, 2])):
        want.add_row(ids, row)
    expected = slots(want, 3, [0, 3, 4, 6], [0, 5, 6, 2, 4, 7])
    assert got == expected, (
        "Token at position p of batch row r goes to slot block_table[r, p // block_size] * "
        "block_size + p % block_size; query_start_loc says which tokens are row r's. With "
        "block_size 4, rows [7, 9], [3], [5, 2] and positions (row 0) 0, 5, 6, (row 1) 2, "
        f"(row 2) 4, 7: expected {expected[:6]} then -1 padding, got {got}."
    )


@pytest.mark.points(2)
def test_slots_past_the_step_are_padding(impl):
    t = table(impl.block_table.BlockTable, max_tokens=8)
    written(t.add_row, [2], 0)
    t.slot_mapping.gpu.fill_(12345)  # a previous, longer step's slots
    got = slots(t, 1, [0, 2], [1, 2])
    assert got[2:] == [PAD_SLOT_ID] * 6, (
        f"Every slot past the step's {2} tokens must be PAD_SLOT_ID ({PAD_SLOT_ID}), up to "
        "max_num_batched_tokens: the KV-cache write skips them, and a stale slot from a "
        f"longer step would overwrite a live block. Got {got}."
    )
    assert got[:2] == [9, 10], f"Block 2, offsets 1 and 2: slots 9, 10; got {got[:2]}."


@pytest.mark.points(3)
def test_slot_mapping_reads_the_committed_table_only(impl):
    """Rows edited after commit_block_table are not seen until the next
    commit (as upstream's kernel reads block_table.gpu). Block 7 holds slots
    28-31, block 9 slots 36-39, block 11 slots 44-47."""
    got = []
    for cls in (impl.block_table.BlockTable, ReferenceBlockTable):
        t = table(cls, max_num_reqs=2, max_blocks=3)
        written(t.add_row, [7, 9], 0)
        t.commit_block_table(1)
        written(t.append_row, [11], 0)  # on the host only, until the next commit
        device = t.block_table.gpu.device
        qsl = torch.tensor([0, 3], dtype=torch.int32, device=device)
        pos = torch.tensor([0, 5, 8], device=device)
        written(t.compute_slot_mapping, 1, qsl, pos)
        before = t.slot_mapping.gpu.tolist()
        got.append((before, slots(t, 1, [0, 3], [0, 5, 8])))
    assert got[0] == got[1], (
        "compute_slot_mapping reads the device copy of the table (block_table.gpu), which "
        "commit_block_table fills; the host copy (block_table.np) may already hold edits for "
        "the next step. Row [7, 9] was committed, then [11] appended on the host: before the "
        f"next commit position 8 must still read the committed row. Expected (before, after "
        f"the next commit) {got[1]}, got {got[0]}."
    )


def _case(seed, num_reqs, block_size):
    """Random rows (0 to 5 blocks each) and, per row, random positions its blocks cover."""
    gen = np.random.default_rng(seed)
    rows = [gen.integers(0, 10_000, int(gen.integers(0, 6))).tolist() for _ in range(num_reqs)]
    qsl, positions = [0], []
    for ids in rows:
        room = len(ids) * block_size
        # Any positions in the row's blocks, in any order (a chunk is consecutive;
        # the mapping does not need it to be).
        positions += gen.integers(0, max(room, 1), int(gen.integers(0, min(room, 30) + 1))).tolist()
        qsl.append(len(positions))
    return rows, qsl, positions


def _mapping_case(impl, other, block_size, num_reqs, seed):
    rows, qsl, positions = _case(seed, num_reqs, block_size)
    mine = impl.block_table.BlockTable(block_size, num_reqs + 2, 5, 128, False, CPU)
    theirs = other(block_size, num_reqs + 2, 5, 128)
    for t in (mine, theirs):
        for row, ids in enumerate(rows):
            written(t.add_row, ids, row)
        t.slot_mapping.gpu.fill_(12345)  # stale values must be overwritten
    got, want = (slots(t, num_reqs, qsl, positions) for t in (mine, theirs))
    return got, want, qsl, positions


CASES = dict(
    block_size=st.sampled_from([1, 2, 16, 64]),
    num_reqs=st.integers(0, 6),
    seed=st.integers(0, 2**32 - 1),
)


@pytest.mark.points(3)
@PROPERTY
@given(**CASES)
def test_random_tables_match_the_reference(impl, block_size, num_reqs, seed):
    got, want, qsl, positions = _mapping_case(
        impl, lambda *a: ReferenceBlockTable(*a, False, CPU), block_size, num_reqs, seed
    )
    assert got == want, (
        f"Slot mapping differs from the reference's: block_size {block_size}, "
        f"query_start_loc {qsl}, positions {positions}.\n  reference: {want}\n  yours:     {got}"
    )


@pytest.mark.upstream
@pytest.mark.points(5)
@pytest.mark.timeout(120)
@PROPERTY
@given(**CASES)
def test_random_tables_match_upstreams_triton_kernel(impl, block_size, num_reqs, seed):
    got, want, qsl, positions = _mapping_case(impl, upstream_table, block_size, num_reqs, seed)
    assert got == want, (
        "Slot mapping differs from upstream's Triton kernel (_compute_slot_mapping_kernel, "
        f"vllm/v1/worker/block_table.py): block_size {block_size}, query_start_loc {qsl}, "
        f"positions {positions}.\n  upstream: {want}\n  yours:    {got}"
    )


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add_row"), st.integers(0, 3), st.lists(st.integers(1, 99), max_size=3)),
        st.tuples(
            st.just("append_row"), st.integers(0, 3), st.lists(st.integers(1, 99), max_size=3)
        ),
        st.tuples(st.just("clear_row"), st.integers(0, 3)),
        st.tuples(st.just("move_row"), st.integers(0, 3), st.integers(0, 3)),
        st.tuples(st.just("swap_row"), st.integers(0, 3), st.integers(0, 3)),
    ),
    max_size=25,
)


@pytest.mark.upstream
@pytest.mark.points(4)
@pytest.mark.timeout(120)
@PROPERTY
@given(ops=OPS)
def test_row_edits_match_upstreams_block_table(impl, ops):
    mine = impl.block_table.BlockTable(4, 4, 12, 16, False, CPU)
    theirs = upstream_table(4, 4, 12, 16)
    done = []
    for name, *args in ops:
        if name in ("add_row", "append_row"):
            ids, row = args[1], args[0]
            if int(theirs.num_blocks_per_row[row]) + len(ids) > 12 and name == "append_row":
                continue  # a row holds at most max_num_blocks_per_req blocks
            args = [ids, row]
        done.append(f"{name}{tuple(args)}")
        written(getattr(mine, name), *args)
        getattr(theirs, name)(*args)
        assert state(mine) == state(theirs), (
            f"After {' -> '.join(done)}\nyour rows differ from upstream's BlockTable "
            f"(vllm/v1/worker/block_table.py).\n  upstream: {state(theirs)}\n  yours:    "
            f"{state(mine)}"
        )
