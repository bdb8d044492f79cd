"""Lab 10.1 — GGUF block formats by hand.

Graded: the three ``LAB 10.1`` regions of ``ggml_dequantize`` in
``labs/phase_10/gguf.py``: a block's fp16 scale ``d``, Q8_0 (32 signed
bytes times ``d``), Q4_0 and Q4_1 (32 four-bit values in 16 bytes, low
nibbles first; ``(q - 8) * d``, or ``d * q + m`` with an fp16 minimum).

Everything is compared, bit for bit (float32 bit patterns, not closeness),
with the ``gguf`` package's own ``gguf.quants.dequantize``, the code
llama.cpp's Python tools and upstream's GGUF loader read these files with:
on blocks ``gguf.quants.quantize`` made, on arbitrary bytes (any finite fp16
scale and minimum, any nibbles), and on SmolLM2's own Q4_1 and Q8_0 tensors.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from phase10_helpers import written

FORMATS = [T.Q8_0, T.Q4_0, T.Q4_1]

pytestmark = pytest.mark.timeout(60)


def bits(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).view(np.uint32)


def first_difference(impl, packed: np.ndarray, qtype: T, rows: int, cols: int) -> str | None:
    """None if your dequantization equals gguf's bit for bit; else the first block that differs."""
    ours = written(impl.gguf.ggml_dequantize, torch.from_numpy(packed.copy()), qtype, rows, cols)
    assert ours.dtype == torch.float32 and tuple(ours.shape) == (rows, cols), (
        f"{qtype.name}: ggml_dequantize must return float32 [{rows}, {cols}], got "
        f"{ours.dtype} {list(ours.shape)}"
    )
    want = gguf.quants.dequantize(packed, qtype).reshape(rows, cols)
    got = ours.numpy()
    wrong = np.argwhere(bits(got) != bits(want))
    if len(wrong) == 0:
        return None
    r, c = (int(v) for v in wrong[0])
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = packed[r, c // block * size : (c // block + 1) * size]
    return (
        f"{qtype.name}, row {r}, weight {c} (weight {c % block} of its block of {block}; the "
        f"block's {size} bytes: {raw.tolist()}): gguf.quants.dequantize gives {want[r, c]!r}, "
        f"yours {got[r, c]!r} ({len(wrong)} of {got.size} weights differ)"
    )


@pytest.mark.points(3)
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_blocks_gguf_quantized(impl, qtype):
    w = np.random.default_rng(0).normal(0, 0.3, size=(24, 256)).astype(np.float32)
    packed = gguf.quants.quantize(w, qtype)
    problem = first_difference(impl, packed, qtype, 24, 256)
    assert problem is None, (
        f"blocks gguf.quants.quantize made from random weights: {problem}. " + HOW[qtype]
    )


@pytest.mark.points(3)
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_any_bytes(impl, qtype):
    """Any byte pattern, with d (and Q4_1's m) any finite fp16 of either sign."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(1)
    packed = rng.integers(0, 256, size=(12, 8 * size), dtype=np.uint8)
    blocks = packed.reshape(-1, size)
    for f in range(2 if qtype == T.Q4_1 else 1):  # d, and Q4_1's minimum
        values = rng.normal(0, 2, size=len(blocks)).astype(np.float16)
        blocks[:, 2 * f : 2 * f + 2] = values.view(np.uint8).reshape(-1, 2)
    problem = first_difference(impl, packed, qtype, 12, 8 * block)
    assert problem is None, f"random bytes: {problem}. " + HOW[qtype]


@pytest.mark.points(4)
def test_smollm2_tensors(impl):
    """SmolLM2's GGUF: its token embedding (Q8_0) and two Q4_1 layers."""
    from mini_vllm.model_executor.model_loader import smollm2_gguf_path

    reader = gguf.GGUFReader(str(smollm2_gguf_path()))
    tensors = {t.name: t for t in reader.tensors}
    for name in ("token_embd.weight", "blk.7.attn_v.weight", "blk.29.ffn_down.weight"):
        t = tensors[name]
        rows, cols = int(t.shape[1]), int(t.shape[0])
        problem = first_difference(impl, np.array(t.data), t.tensor_type, rows, cols)
        assert problem is None, f"SmolLM2's {name}: {problem}. " + HOW[T(t.tensor_type)]


HOW = {
    T.Q8_0: "Q8_0 is 34 bytes a block: d (fp16, bytes 0-1), then 32 int8 q; w = q * d.",
    T.Q4_0: (
        "Q4_0 is 18 bytes a block: d (fp16), then 16 bytes of 4-bit q, low nibbles first "
        "(weights 0-15), high nibbles after (16-31); w = (q - 8) * d."
    ),
    T.Q4_1: (
        "Q4_1 is 20 bytes a block: d and a minimum m (both fp16), then 16 bytes of 4-bit q, "
        "low nibbles first (weights 0-15), high nibbles after (16-31); w = d * q + m, in float32."
    ),
}
