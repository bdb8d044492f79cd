"""Live lockstep: mini_vllm's persistent batch and block table against the
pinned upstream's, operation for operation.

Hypothesis generates runner-shaped workloads (mini_vllm/oracle/batch_workload.py):
requests with random prompts and sampling parameters join the batch, leave
it (finished or preempted), come back with new blocks, get new blocks and
computed-token counts, are condensed, swapped and refreshed, and append the
tokens they sample. After every operation both batches must show the same
rows: order of requests, each request's row, token ids, counts, block ids,
per-row sampling parameters; after ``refresh_metadata`` the same sampling
metadata and min_tokens rows; and the same slot mapping for a batch of
tokens, where upstream's is computed by its Triton kernel under the
interpreter. A failure names the first operation and field that differ.

MINI_VLLM_BATCH_LOCKSTEP_EXAMPLES sets the number of generated cases (default 60).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from mini_vllm.oracle.batch_workload import (
    UPSTREAM_DEVICE,
    MiniSide,
    UpstreamSide,
    batch_workloads,
    first_batch_difference,
    run_batch_workload,
    upstream_block_table_module,
)
from mini_vllm.tiers import examples
from mini_vllm.worker.block_table import PAD_SLOT_ID, BlockTable

pytestmark = pytest.mark.upstream

EXAMPLES = examples(60, 30, "MINI_VLLM_BATCH_LOCKSTEP_EXAMPLES")


# No shrinking: it takes minutes on these nested workloads, and the message
# already names the first operation and field that differ.
@pytest.mark.xdist_group("batch-lockstep")
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(workload=batch_workloads())
def test_input_batch_lockstep_with_upstream(counts, workload):
    expected = run_batch_workload(UpstreamSide, workload)
    got = run_batch_workload(MiniSide, workload)
    counts["batch lockstep examples"] = counts.get("batch lockstep examples", 0) + 1
    for op, _ in expected:
        kind = op.split(": ", 1)[1].split("(", 1)[0].split(" ")[0]
        counts[f"batch lockstep op {kind}"] = counts.get(f"batch lockstep op {kind}", 0) + 1
    diff = first_batch_difference(expected, got)
    assert diff is None, f"{diff}\nconfig: {workload.config}\nsteps: {workload.steps}"


@pytest.mark.xdist_group("batch-lockstep")
def test_generated_batch_workloads_reach_holes_swaps_and_slots(counts):
    """The lockstep proves little unless it condenses real holes, swaps rows
    and maps tokens to slots. Runs after the lockstep test in this module."""
    if counts.get("batch lockstep examples", 0) < 20:
        pytest.skip("too few batch lockstep examples ran to judge coverage")
    for kind in ("remove_request", "swap_states", "add_request", "compute_slot_mapping"):
        assert counts.get(f"batch lockstep op {kind}", 0) > 0, (kind, counts)


def _random_table(gen: np.random.Generator, block_size: int, num_reqs: int, max_blocks: int):
    table = BlockTable(block_size, num_reqs + 2, max_blocks, 256, False, torch.device("cpu"))
    for row in range(num_reqs):
        n = int(gen.integers(0, max_blocks + 1))
        table.add_row(gen.integers(0, 10_000, n).tolist(), row)
    return table


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    block_size=st.sampled_from([1, 2, 16, 64]),
    num_reqs=st.integers(0, 6),
    seed=st.integers(0, 2**32 - 1),
)
def test_compute_slot_mapping_matches_upstream_kernel(block_size, num_reqs, seed):
    """Random block tables and positions: mini's torch slot mapping equals
    upstream's Triton kernel, padding included."""
    gen = np.random.default_rng(seed)
    table = _random_table(gen, block_size, num_reqs, max_blocks=5)
    upstream = upstream_block_table_module().BlockTable(
        block_size, num_reqs + 2, 5, 256, False, UPSTREAM_DEVICE, block_size, 1
    )
    upstream.block_table.np[:] = table.block_table.np
    upstream.num_blocks_per_row[:] = table.num_blocks_per_row
    qsl, positions = [0], []
    for row in range(num_reqs):
        room = int(table.num_blocks_per_row[row]) * block_size
        q = int(gen.integers(0, min(room, 40) + 1))
        # Any positions the row's blocks cover, in any order (a chunk is
        # consecutive; the mapping does not need it to be).
        positions.extend(gen.integers(0, max(room, 1), q).tolist() if room else [])
        qsl.append(len(positions))
    query_start_loc = torch.tensor(qsl, dtype=torch.int32)
    pos = torch.tensor(positions, dtype=torch.int64)
    for t in (table, upstream):
        t.slot_mapping.gpu.fill_(12345)  # stale values must be overwritten
        t.commit_block_table(num_reqs)
        t.compute_slot_mapping(num_reqs, query_start_loc.to(t.device), pos.to(t.device))
    got, want = table.slot_mapping.gpu, upstream.slot_mapping.gpu.cpu()
    assert torch.equal(got, want), (block_size, qsl, positions, got, want)
    assert (got[len(positions) :] == PAD_SLOT_ID).all()


def test_slot_mapping_reads_the_committed_table_only():
    """As upstream, rows edited after commit_block_table are not seen until
    the next commit: block 7 holds slots 28-31, block 9 slots 36-39."""
    upstream_cls = upstream_block_table_module().BlockTable
    tables = [
        BlockTable(4, 2, 3, 8, False, torch.device("cpu")),
        upstream_cls(4, 2, 3, 8, False, UPSTREAM_DEVICE, 4, 1),
    ]
    qsl, pos = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 5, 8])
    seen = []
    for table in tables:
        table.add_row([7, 9], 0)
        table.commit_block_table(1)
        table.append_row([11], 0)
        table.compute_slot_mapping(1, qsl.to(table.device), pos.to(table.device))
        before = table.slot_mapping.gpu.tolist()
        table.commit_block_table(1)
        table.compute_slot_mapping(1, qsl.to(table.device), pos.to(table.device))
        seen.append((before, table.slot_mapping.gpu.tolist()))
    assert seen[0] == seen[1], seen
    assert seen[0] == ([28, 37, 0, -1, -1, -1, -1, -1], [28, 37, 44, -1, -1, -1, -1, -1])
