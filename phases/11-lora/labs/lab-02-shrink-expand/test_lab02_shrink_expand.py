"""Lab 11.2 — shrink and expand: the LoRA matmuls of a mixed batch.

Graded: the ``LAB 11.2`` regions of ``labs/phase_11/lora_ops.py``: the BGMV
ops (one slot index a row: ``bgmv_shrink``, ``bgmv_expand``,
``bgmv_expand_slice``) and the SGMV ops (one slot index a segment of rows:
``sgmv_shrink``, ``sgmv_expand``, ``sgmv_expand_slice``).

Marked ``upstream``: every test runs your op and the pinned upstream's own
torch op (vllm/lora/ops/torch_ops/lora_ops.py, the reference its Triton and
punica kernels are checked against) on the same generated inputs
(phase11_helpers.op_cases: 1-5 slots, ranks 1-16, segments of 1-6 rows,
slot -1 for rows without an adapter, 3-D or 4-D stacks, float32 or bfloat16
weights, outputs wider than the adapter's) and demands the same output, row
for row, to float32 rounding.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from phase11_helpers import assert_same, op_cases, written

from mini_vllm.grading.checks import lab_settings

pytestmark = pytest.mark.upstream

CASES = lab_settings(60)


def run_both(impl, up_ops, name: str, output, *args):
    """(yours, upstream's) outputs of op ``name`` on copies of ``output``."""
    ours, theirs = output.clone(), output.clone()
    written(getattr(impl.lora_ops, name), args[0], args[1], ours, *args[2:])
    getattr(up_ops, name)(args[0], args[1], theirs, *args[2:])
    return ours, theirs


@pytest.mark.points(4)
@CASES
@given(case=op_cases())
def test_bgmv_shrink(impl, up_ops, case):
    out = case.h.new_zeros(case.h.shape)
    ours, theirs = run_both(impl, up_ops, "bgmv_shrink", out, case.x, case.a, case.rows, case.scale)
    assert_same(
        "bgmv_shrink", ours, theirs, case, f"each row: scale {case.scale} * lora_a[slot] @ x"
    )


@pytest.mark.points(4)
@CASES
@given(case=op_cases())
def test_bgmv_expand(impl, up_ops, case):
    for add in (True, False):
        ours, theirs = run_both(impl, up_ops, "bgmv_expand", case.y, case.h, case.b, case.rows, add)
        assert_same(
            "bgmv_expand",
            ours,
            theirs,
            case,
            f"add_inputs={add}: each row's lora_b[slot] @ h, "
            f"{'added to' if add else 'written over'} the output's first columns, as many as "
            "both have",
        )


@pytest.mark.points(3)
@CASES
@given(case=op_cases())
def test_bgmv_expand_slice(impl, up_ops, case):
    for add in (True, False):
        ours, theirs = run_both(
            impl,
            up_ops,
            "bgmv_expand_slice",
            case.y_slice,
            case.h,
            case.b,
            case.rows,
            case.offset,
            case.d_out,
            add,
        )
        assert_same(
            "bgmv_expand_slice",
            ours,
            theirs,
            case,
            f"add_inputs={add}: into columns {case.offset}:{case.offset + case.d_out} only",
        )


@pytest.mark.points(3)
@CASES
@given(case=op_cases())
def test_sgmv_shrink(impl, up_ops, case):
    out = case.h.new_zeros(case.h.shape)
    ours, theirs = run_both(
        impl, up_ops, "sgmv_shrink", out, case.x, case.a, *case.meta, case.scale
    )
    assert_same("sgmv_shrink", ours, theirs, case, "each segment's slot index covers all its rows")


@pytest.mark.points(3)
@CASES
@given(case=op_cases())
def test_sgmv_expand(impl, up_ops, case):
    for add in (True, False):
        ours, theirs = run_both(
            impl, up_ops, "sgmv_expand", case.y, case.h, case.b, *case.meta, add
        )
        assert_same(
            "sgmv_expand", ours, theirs, case, f"add_inputs={add}, one slot index a segment"
        )


@pytest.mark.points(3)
@CASES
@given(case=op_cases())
def test_sgmv_expand_slice(impl, up_ops, case):
    for add in (True, False):
        ours, theirs = run_both(
            impl,
            up_ops,
            "sgmv_expand_slice",
            case.y_slice,
            case.h,
            case.b,
            *case.meta,
            case.offset,
            case.d_out,
            add,
        )
        assert_same(
            "sgmv_expand_slice",
            ours,
            theirs,
            case,
            f"add_inputs={add}: one slot index a segment, into columns "
            f"{case.offset}:{case.offset + case.d_out}",
        )


@pytest.mark.points(2)
@CASES
@given(case=op_cases())
def test_one_result_row_fills_only_the_first_output_row(impl, up_ops, case):
    """Upstream's edge case in bgmv_expand: a single row of results against an
    output of several rows fills (or adds into) the first row only."""
    for add in (True, False):
        ours, theirs = run_both(
            impl, up_ops, "bgmv_expand", case.y, case.h[:1], case.b, case.rows[:1], add
        )
        assert_same(
            "bgmv_expand",
            ours,
            theirs,
            case,
            f"one result row, {case.y.shape[0]} output rows, add_inputs={add}: upstream changes "
            "only the first output row",
        )
