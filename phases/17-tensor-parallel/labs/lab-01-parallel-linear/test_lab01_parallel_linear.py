"""Lab 17.1 — column- and row-parallel linears and the collectives under them.

Graded: the ``LAB 17.1`` regions of ``labs/phase_17/parallel_state.py``
(``GroupCoordinator.all_reduce``, ``all_gather``) and
``labs/phase_17/linear.py`` (``ColumnParallelLinear.checkpoint_layout`` and
``forward``, ``RowParallelLinear.checkpoint_layout`` and ``forward``).

Two gloo ranks (spawned processes) join one process group; in each, your
group is the tensor-parallel group (``initialize_model_parallel`` builds
your ``GroupCoordinator``) and the pinned upstream's parallel state sits on
the same ranks. Each rank runs your collectives beside upstream's
``get_tp_group()``'s on the same tensors, then builds each layer twice,
yours and upstream's (``vllm.model_executor.layers.linear``), with the same
sizes, loads both from the same whole checkpoint tensors through their
``weight_loader`` and runs both on the same input. On every rank the shard
shapes, the loaded shards and the outputs must be upstream's.
"""

from __future__ import annotations

import pytest
import torch

from mini_vllm.grading.tp_checks import collectives_and_linears, run_ranks, section

pytestmark = pytest.mark.upstream
TP = 2
LAB = "17.1"


@pytest.fixture(scope="module")
def ranks():
    """What each of the two ranks computed, yours beside upstream's (one run for the lab)."""
    return run_ranks(collectives_and_linears, TP, lab=LAB, upstream=True)


def check_layer(results: list[dict], name: str) -> None:
    for rank, got in enumerate(results):
        got = section(got, name)
        for param, (mine, up) in got["shapes"].items():
            assert mine == up, (
                f"rank {rank}, {name}: your {param} shard has shape {mine}, upstream's {up}: "
                "each rank holds an equal slice (a column layer: rows of the output; a row "
                "layer: columns of the input)"
            )
        for param, equal in got["weights_equal"].items():
            assert equal, (
                f"rank {rank}, {name}: your loaded {param} differs from upstream's: the "
                "checkpoint's slice this rank keeps is not upstream's (checkpoint_layout)"
            )
        assert got["mini_y"].shape == got["up_y"].shape, (
            f"rank {rank}, {name}: your output has shape {tuple(got['mini_y'].shape)}, "
            f"upstream's {tuple(got['up_y'].shape)}"
        )
        diff = (got["mini_y"] - got["up_y"]).abs().max().item()
        assert diff <= 1e-5, (
            f"rank {rank}, {name}: your output differs from upstream's by {diff:.2e}"
        )


@pytest.mark.points(3)
@pytest.mark.timeout(240)
def test_all_reduce_sums_over_the_ranks_as_upstreams(ranks, impl):
    for rank, got in enumerate(ranks):
        got = section(got, "all_reduce")
        for shape, mine, up in got["results"]:
            assert mine.shape == up.shape and torch.allclose(mine, up, atol=1e-6), (
                f"rank {rank}: all_reduce of a {shape} tensor: yours {mine.flatten()[:4]}..., "
                f"upstream's {up.flatten()[:4]}...: every rank must get the element-wise sum"
            )
        assert got["calls"] == len(got["results"]), (
            f"rank {rank}: comm_calls['all_reduce'] grew by {got['calls']} over "
            f"{len(got['results'])} all-reduces: count each call (self._count)"
        )
        assert got["bytes"] == got["sent"], (
            f"rank {rank}: comm_bytes['all_reduce'] grew by {got['bytes']}; the inputs held "
            f"{got['sent']} bytes"
        )


@pytest.mark.points(4)
@pytest.mark.timeout(240)
def test_all_gather_concatenates_along_every_dim_as_upstreams(ranks, impl):
    for rank, got in enumerate(ranks):
        got = section(got, "all_gather")
        for dim, mine, up in got["results"]:
            assert mine.shape == up.shape, (
                f"rank {rank}: all_gather of a [2, 3, 4] tensor along dim {dim}: your shape "
                f"{tuple(mine.shape)}, upstream's {tuple(up.shape)}"
            )
            assert torch.equal(mine, up), (
                f"rank {rank}: all_gather along dim {dim}: the shape is right but the values "
                "are not upstream's: every rank's tensor, in rank order, concatenated along dim"
            )
        assert got["calls"] == len(got["results"]), (
            f"rank {rank}: comm_calls['all_gather'] grew by {got['calls']} over "
            f"{len(got['results'])} all-gathers"
        )


@pytest.mark.points(4)
@pytest.mark.timeout(240)
def test_column_parallel_keeps_its_rows_and_gives_its_slice(ranks, impl):
    check_layer(ranks, "column gather_output=False")


@pytest.mark.points(3)
@pytest.mark.timeout(240)
def test_column_parallel_gather_output_gives_every_rank_all_of_y(ranks, impl):
    check_layer(ranks, "column gather_output=True")


@pytest.mark.points(3)
@pytest.mark.timeout(240)
def test_merged_gate_up_splits_each_shard_on_its_own(ranks, impl):
    check_layer(ranks, "merged")


@pytest.mark.points(4)
@pytest.mark.timeout(240)
def test_row_parallel_keeps_its_columns_and_all_reduces(ranks, impl):
    check_layer(ranks, "row")


@pytest.mark.points(2)
@pytest.mark.timeout(240)
def test_row_parallel_slices_a_whole_input(ranks, impl):
    check_layer(ranks, "row input_is_parallel=False")


@pytest.mark.points(2)
@pytest.mark.timeout(240)
def test_row_parallel_without_reduce_gives_partial_sums(ranks, impl):
    check_layer(ranks, "row reduce_results=False")
