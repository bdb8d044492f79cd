"""LoRA shrink/expand ops and the batch's slot mapping against the pinned upstream.

mini_vllm/lora/ops/torch_ops/lora_ops.py must equal upstream's own torch ops
(vllm/lora/ops/torch_ops/lora_ops.py, imported from the installed vllm) on
the same inputs, and both must equal a plain per-row matmul (einsum) of each
row's adapter. The slot mapping (mini_vllm/lora/punica_wrapper/) must give
upstream's ``PunicaWrapperCPU`` indices and segments, and ``add_lora_linear``
its output, for batches that mix adapters and rows without one, and a row
without an adapter must take upstream's last slot on a CPU where mini's spare
zero slot gives it nothing (UPSTREAM_PIN.md, Phase 11).
"""

from __future__ import annotations

import functools
import os
import types

import pytest
import torch
from torch import nn

import mini_vllm.lora.ops.torch_ops as mini_ops
from mini_vllm.lora.layers import BaseLinearLayerWithLoRA
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


def _upstream_layer(max_loras: int, rank: int, d_in: int, d_out: int):
    """Upstream's own LoRA layer stacks on a bare ReplicatedLinear (no model, no TP)."""
    from vllm.config.lora import LoRAConfig
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA as Upstream
    from vllm.model_executor.layers.linear import ReplicatedLinear

    layer = Upstream.__new__(Upstream)
    nn.Module.__init__(layer)
    layer.base_layer = ReplicatedLinear.__new__(ReplicatedLinear)
    layer.input_size, layer.output_size, layer.device = d_in, d_out, "cpu"
    layer.n_slices, layer.tp_size = 1, 1
    config = LoRAConfig(max_lora_rank=rank, max_loras=max_loras, lora_dtype=torch.float32)
    layer.create_lora_weights(max_loras, config)
    return layer


@pytest.mark.parametrize(
    ("slot_ids", "deactivate", "base_row_takes"),
    [
        ((1, 2), None, 2),  # both slots hold an adapter: the row without one takes the last (id 2)
        ((1, None), None, None),  # the last slot never held one (zero): the row adds nothing
        ((1, 2), 2, 2),  # id 2 deactivated: its slot is freed but its weights stay
    ],
)
def test_row_without_adapter_takes_the_last_slot_upstream(
    up_punica, slot_ids, deactivate, base_row_takes
):
    from vllm.lora.model_manager import LoRAModelManager

    upstream_cls, lora_mapping = up_punica
    max_loras, rank, d_in, d_out = 2, 8, 16, 12
    up = _upstream_layer(max_loras, rank, d_in, d_out)
    assert up.lora_a_stacked[0].shape[0] == max_loras  # upstream: no spare slot
    base = nn.Linear(d_in, d_out, bias=False)
    base.input_size, base.output_sizes = d_in, (d_out,)
    ours = BaseLinearLayerWithLoRA(base)
    ours.create_lora_weights(max_loras, rank, torch.float32, torch.device("cpu"))
    assert ours.lora_a_stacked[0].shape[0] == max_loras + 1  # mini: one spare zero slot

    g = torch.Generator().manual_seed(7)
    adapters = {}
    for slot, lora_id in enumerate(slot_ids):
        if lora_id is None:
            continue
        a, b = torch.randn(rank, d_in, generator=g), torch.randn(d_out, rank, generator=g)
        adapters[lora_id] = (a, b)
        up.set_lora(slot, a, b)
        ours.set_lora(slot, [a], [b])
    # upstream's own deactivation, on a manager holding only the slot table
    manager = types.SimpleNamespace(lora_index_to_id=list(slot_ids))
    if deactivate is not None:
        LoRAModelManager._deactivate_adapter(manager, deactivate)
    index_to_id = manager.lora_index_to_id

    token_ids = tuple(i for i in (1, 1, 0, 2) if i == 0 or i in index_to_id)
    theirs = upstream_cls(64, 8, "cpu")
    # the model manager passes lora_slots + 1 (vllm/lora/model_manager.py:365)
    theirs.update_metadata(
        lora_mapping(token_ids, token_ids, is_prefill=True), index_to_id, max_loras + 1, 1000
    )
    n = len(token_ids)
    assert theirs.token_lora_indices[:n].tolist() == [
        index_to_id.index(i) if i else -1 for i in token_ids
    ]
    assert not theirs.no_lora  # a mixed batch runs the ops on every row
    ours.punica_wrapper = PunicaWrapperCPU()
    ours.punica_wrapper.update_metadata(token_ids, index_to_id)

    x = torch.randn(n, d_in, generator=g)
    y_up, y_ours = torch.zeros(n, d_out), torch.zeros(n, d_out)
    theirs.add_lora_linear(y_up, x, up.lora_a_stacked, up.lora_b_stacked, 1.0, up.output_slices)
    ours.punica_wrapper.add_lora_linear(
        y_ours, x, ours.lora_a_stacked, ours.lora_b_stacked, 1.0, ours.output_slices
    )

    def delta(row, lora_id):
        a, b = adapters[lora_id]
        return (x[row] @ a.T) @ b.T

    for row, lora_id in enumerate(token_ids):
        if lora_id == 0:
            assert torch.equal(y_ours[row], torch.zeros(d_out))  # mini: nothing
            if base_row_takes is None:
                assert torch.equal(y_up[row], torch.zeros(d_out))
            else:  # upstream: the last slot's adapter
                torch.testing.assert_close(y_up[row], delta(row, base_row_takes))
                assert y_up[row].abs().max() > 1.0
        else:
            torch.testing.assert_close(y_up[row], delta(row, lora_id))
            assert torch.equal(y_ours[row], y_up[row])
