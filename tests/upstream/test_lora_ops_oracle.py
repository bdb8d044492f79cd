"""LoRA shrink/expand ops and the batch's slot mapping against the pinned upstream.

mini_vllm/lora/ops/torch_ops/lora_ops.py must equal upstream's own torch ops
(vllm/lora/ops/torch_ops/lora_ops.py, imported from the installed vllm) on
the same inputs, and both must equal a plain per-row matmul (einsum) of each
row's adapter. The slot mapping (mini_vllm/lora/punica_wrapper/) must give
upstream's ``PunicaWrapperCPU`` indices and segments, and ``add_lora_linear``
its output, for batches that mix adapters and rows without one.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

import mini_vllm.lora.ops.torch_ops as mini_ops
from mini_vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

pytestmark = pytest.mark.upstream

os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")


@pytest.fixture(scope="module")
def up_ops():
    import vllm.lora.ops.torch_ops as ops

    return ops


@pytest.fixture(scope="module")
def up_punica():
    import vllm.lora.punica_wrapper.utils as utils
    from vllm.lora.layers.utils import LoRAMapping
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU as Upstream

    # Upstream copies indices through pinned memory, which needs CUDA.
    if not isinstance(utils.async_tensor_h2d, functools.partial):
        utils.async_tensor_h2d = functools.partial(utils.async_tensor_h2d, pin_memory=False)
    return Upstream, LoRAMapping


def _case(seed: int, slots=4, rank=8, d_in=24, d_out=40, segments=(3, 1, 5, 2, 1), squeeze=True):
    g = torch.Generator().manual_seed(seed)
    tokens = sum(segments)
    seg_slots = torch.randint(-1, slots - 1, (len(segments),), generator=g)
    lengths = torch.tensor(segments)
    starts = torch.zeros_like(lengths)
    starts[1:] = torch.cumsum(lengths, 0)[:-1]
    a = torch.randn(slots, rank, d_in, generator=g)
    b = torch.randn(slots, d_out, rank, generator=g)
    a[-1] = 0  # the last slot stands for "no adapter" (index -1)
    b[-1] = 0
    if squeeze:  # upstream stacks (slots, 1, out, in)
        a, b = a.unsqueeze(1), b.unsqueeze(1)
    meta = (starts, lengths, seg_slots, len(segments), int(lengths.max()), tokens)
    return {
        "x": torch.randn(tokens, d_in, generator=g),
        "h": torch.randn(tokens, rank, generator=g),
        "y": torch.randn(tokens, d_out + 8, generator=g),
        "a": a,
        "b": b,
        "meta": meta,
        "rows": torch.repeat_interleave(seg_slots, lengths),
    }


def _einsum_a(c):
    a = c["a"].reshape(c["a"].shape[0], *c["a"].shape[-2:])
    return torch.einsum("ti,tri->tr", c["x"], a[c["rows"]])


def _einsum_b(c):
    b = c["b"].reshape(c["b"].shape[0], *c["b"].shape[-2:])
    return torch.einsum("tr,tor->to", c["h"], b[c["rows"]])


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("squeeze", [True, False])
def test_shrink_matches_upstream_and_einsum(up_ops, seed, squeeze):
    c = _case(seed, squeeze=squeeze)
    want = 0.5 * _einsum_a(c)
    for name, args in [
        ("bgmv_shrink", (c["rows"], 0.5)),
        ("sgmv_shrink", (*c["meta"], 0.5)),
    ]:
        ours = torch.zeros(len(c["x"]), c["h"].shape[1])
        theirs = ours.clone()
        getattr(mini_ops, name)(c["x"], c["a"], ours, *args)
        getattr(up_ops, name)(c["x"], c["a"], theirs, *args)
        assert torch.equal(ours, theirs), name
        torch.testing.assert_close(ours, want, msg=name)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("add_inputs", [True, False])
def test_expand_matches_upstream_and_einsum(up_ops, seed, add_inputs):
    c = _case(seed)
    d_out = c["b"].shape[-2]
    delta = _einsum_b(c)
    cases = [
        ("bgmv_expand", (c["rows"], add_inputs), slice(0, d_out)),
        ("sgmv_expand", (*c["meta"], add_inputs), slice(0, d_out)),
        ("bgmv_expand_slice", (c["rows"], 5, d_out, add_inputs), slice(5, 5 + d_out)),
        ("sgmv_expand_slice", (*c["meta"], 5, d_out, add_inputs), slice(5, 5 + d_out)),
    ]
    for name, args, cols in cases:
        ours, theirs = c["y"].clone(), c["y"].clone()
        getattr(mini_ops, name)(c["h"], c["b"], ours, *args)
        getattr(up_ops, name)(c["h"], c["b"], theirs, *args)
        assert torch.equal(ours, theirs), name
        want = c["y"].clone()
        want[:, cols] = (want[:, cols] if add_inputs else 0) + delta
        torch.testing.assert_close(ours, want, msg=name)


MAPPINGS = [
    # token adapter ids (0: none), the slot order of the layers
    ((1, 1, 1, 0, 2, 2, 1), (1, 2, None)),
    ((0, 0, 0), (1, 2, None)),
    ((2, 2, 2, 2), (1, 2, None)),
    ((3, 0, 1, 3, 3), (3, 1, None)),
]


@pytest.mark.parametrize(("token_ids", "slot_ids"), MAPPINGS)
def test_slot_mapping_and_add_lora_linear_match_upstream(up_punica, token_ids, slot_ids):
    upstream_cls, lora_mapping = up_punica
    theirs = upstream_cls(64, 8, "cpu")
    theirs.update_metadata(
        lora_mapping(token_ids, token_ids, is_prefill=True), list(slot_ids), len(slot_ids), 1000
    )
    ours = PunicaWrapperCPU()
    ours.update_metadata(token_ids, slot_ids)
    n = len(token_ids)
    assert ours.token_lora_tensor.tolist() == theirs.token_lora_indices[:n].tolist()
    assert ours.no_lora == theirs.no_lora
    if not ours.no_lora:
        for mine, up in zip(ours.prefill_metadata, theirs.prefill_metadata, strict=True):
            assert (mine.tolist() if torch.is_tensor(mine) else mine) == (
                up.tolist() if torch.is_tensor(up) else up
            )

    g = torch.Generator().manual_seed(len(token_ids))
    slots, rank, d_in, sizes = len(slot_ids), 4, 16, (12, 6, 6)  # q, k, v
    a = tuple(torch.randn(slots, 1, rank, d_in, generator=g) for _ in sizes)
    b = tuple(torch.randn(slots, 1, s, rank, generator=g) for s in sizes)
    for t in a + b:
        t[-1] = 0  # the spare slot of rows without an adapter
    x = torch.randn(n, d_in, generator=g)
    y = torch.randn(n, sum(sizes), generator=g)
    y_ours, y_theirs = y.clone(), y.clone()
    ours.add_lora_linear(y_ours, x, a, b, 2.0, sizes)
    theirs.add_lora_linear(y_theirs, x, a, b, 2.0, sizes)
    assert torch.equal(y_ours, y_theirs)
    # and by hand: each row adds its adapter's (x A^T) B^T * scale, a row with none nothing
    want = y.clone()
    for row, lora_id in enumerate(token_ids):
        if lora_id == 0:
            continue
        s = slot_ids.index(lora_id)
        parts = [2.0 * (x[row] @ a[i][s, 0].T) @ b[i][s, 0].T for i in range(len(sizes))]
        want[row] += torch.cat(parts)
    torch.testing.assert_close(y_ours, want)
