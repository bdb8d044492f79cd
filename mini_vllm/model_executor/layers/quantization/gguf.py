"""GGUF weights kept quantized in memory and dequantized layer by layer at run time.

Mirrors upstream ``vllm/model_executor/layers/quantization/gguf.py`` at
v0.22.1: ``GGUFConfig`` (:49), ``is_layer_skipped_gguf`` (:126),
``GGUFLinearMethod`` (:429) with its ``create_weights``,
``process_weights_after_loading``, ``_create_padded_weight_param`` and
``apply``, ``GGUFEmbeddingMethod`` (:670) and ``_apply_gguf_embedding``
(:384); ``ggml_dequantize`` (vllm/_custom_ops.py:2100) stands for
upstream's CUDA op, written here in torch for the legacy block formats.

Left out: the k-quants and i-quants (upstream dequantizes them on the GPU;
mini_vllm refuses them with ``quantization="gguf"`` and dequantizes them at
load without it), the fused quantized matmuls (``ggml_mul_mat_vec_a8`` /
``ggml_mul_mat_a8``, which also quantize the activations to 8 bits), MoE,
torch.compile op registration.

A GGUF file stores a weight [out, in] as rows of blocks; a block holds 32
consecutive weights of a row (``GGML_QUANT_SIZES``: block size, bytes):

- ``Q8_0`` (32, 34): an fp16 scale ``d``, then 32 int8 ``q``: ``w = q * d``;
- ``Q4_0`` (32, 18): ``d``, then 16 bytes of 4-bit ``q`` (low nibbles are
  weights 0-15, high nibbles 16-31): ``w = (q - 8) * d``;
- ``Q4_1`` (32, 20): ``d`` and an fp16 minimum ``m``, then the 16 bytes:
  ``w = q * d + m``.

``qweight`` keeps those bytes, one row of bytes per output row
([out, in / 32 * bytes per block], uint8); ``qweight_type`` the type of
each shard of a fused layer. ``apply`` dequantizes the shards to float32
(the same values, bit for bit, as ``gguf.quants.dequantize``), casts them
to the model's dtype and multiplies: the very matmul that the
dequantize-at-load path does, so the logits are equal. Upstream multiplies
shard by shard and concatenates the outputs; here the dequantized shards
are concatenated first, for that equality.
"""

from __future__ import annotations

import gguf
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as WeightType
from torch import nn

from mini_vllm.model_executor.layers.linear import LinearBase, LinearMethodBase
from mini_vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from mini_vllm.model_executor.layers.vocab_parallel_embedding import (
    UnquantizedEmbeddingMethod,
    VocabParallelEmbedding,
)

UNQUANTIZED_TYPES = {WeightType.F32, WeightType.F16, WeightType.BF16}
DEQUANT_TYPES = {WeightType.Q4_0, WeightType.Q4_1, WeightType.Q8_0}

# The fused layers and the checkpoint layers they are made of.
PACKED_MODULES_MAPPING = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
}


class GGUFConfig(QuantizationConfig):
    """GGUF's in-memory method. ``unquantized_modules``: the layers whose GGUF
    tensors are plain floats (F32/F16/BF16), which keep an ordinary weight."""

    def __init__(self, unquantized_modules: list[str] | None = None) -> None:
        self.unquantized_modules = unquantized_modules or []

    def get_name(self) -> str:
        return "gguf"

    def get_quant_method(self, layer: nn.Module, prefix: str):
        skipped = is_layer_skipped_gguf(prefix, self.unquantized_modules)
        if isinstance(layer, LinearBase):
            return None if skipped else GGUFLinearMethod(self)
        if isinstance(layer, VocabParallelEmbedding):
            return UnquantizedEmbeddingMethod() if skipped else GGUFEmbeddingMethod(self)
        return None


def is_layer_skipped_gguf(prefix: str, unquantized_modules: list[str]) -> bool:
    """Whether the layer ``prefix`` names has unquantized GGUF tensors; a fused layer
    must be all one or the other."""
    proj_name = prefix.split(".")[-1]
    shard_prefixes = [
        prefix.replace(proj_name, shard) for shard in PACKED_MODULES_MAPPING.get(proj_name, [])
    ] or [prefix]
    skipped = {any(p in m for m in unquantized_modules) for p in shard_prefixes}
    if len(skipped) > 1:
        raise ValueError(
            f"Detected some but not all shards of {prefix} are quantized. All shards of "
            "fused layers to have the same precision."
        )
    return skipped.pop()


def ggml_dequantize(
    qweight: torch.Tensor, quant_type: int, m: int, n: int, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``m`` rows of ``n`` weights packed in ``qweight`` (uint8 [m, bytes]) -> [m, n] floats.

    Float32 arithmetic in the order ``gguf.quants`` uses, so the result is
    bit-identical to it; then cast to ``dtype`` (default float32)."""
    quant_type = WeightType(int(quant_type))
    if quant_type not in DEQUANT_TYPES:
        raise NotImplementedError(f"Unsupported GGUF quantization type: {quant_type.name}")
    block_size, type_size = gguf.GGML_QUANT_SIZES[quant_type]
    if qweight.dtype != torch.uint8 or tuple(qweight.shape) != (m, n // block_size * type_size):
        raise ValueError(
            f"qweight must be uint8 [{m}, {n // block_size * type_size}] for {m} rows of {n} "
            f"{quant_type.name} weights, got {qweight.dtype} {list(qweight.shape)}"
        )
    blocks = qweight.reshape(-1, type_size)  # one block a row
    # BEGIN LAB 10.1: a block's fp16 scale d
    # HINT: receives blocks (uint8 [num_blocks, type_size], one block a row); leaves d,
    # HINT: float32 [num_blocks, 1]: the block's first two bytes read as one float16.
    # HINT: a view reinterprets bytes (tensor.view(torch.float16)) where .to() would convert
    # HINT: the numbers; a slice of columns needs .contiguous() before a view.
    d = blocks[:, :2].contiguous().view(torch.float16).float()  # [blocks, 1]
    # END LAB 10.1
    if quant_type == WeightType.Q8_0:
        # BEGIN LAB 10.1: Q8_0: 32 signed bytes times d
        # HINT: receives blocks, d; leaves out, float32 [num_blocks, 32]: w = q * d.
        # HINT: the 32 bytes after d are int8 (two's complement): reinterpret, do not convert.
        q = blocks[:, 2:].contiguous().view(torch.int8).float()
        out = q * d
        # END LAB 10.1
    else:
        # BEGIN LAB 10.1: Q4_0 and Q4_1: 16 bytes of nibbles
        # HINT: receives blocks, d, quant_type, type_size, block_size; leaves out, float32
        # HINT: [num_blocks, 32]. The block's last 16 bytes hold 32 four-bit q: the low
        # HINT: nibbles are weights 0-15, the high nibbles weights 16-31.
        # HINT: Q4_0: w = (q - 8) * d. Q4_1: bytes 2-3 are an fp16 minimum m, w = d * q + m.
        # HINT: gguf.quants computes in float32 in exactly that order: match it bit for bit.
        packed = blocks[:, type_size - block_size // 2 :]  # the 16 bytes of nibbles
        q = torch.cat([packed & 0x0F, packed >> 4], dim=1)
        if quant_type == WeightType.Q4_0:
            out = (q.to(torch.int8) - 8).float() * d
        else:  # Q4_1
            minimum = blocks[:, 2:4].contiguous().view(torch.float16).float()
            out = d * q.float() + minimum
        # END LAB 10.1
    return out.reshape(m, n).to(dtype or torch.float32)


class GGUFLinearMethod(LinearMethodBase):
    """Keeps a layer's GGUF bytes; dequantizes them on every call."""

    def __init__(self, quant_config: GGUFConfig) -> None:
        self.quant_config = quant_config

    def create_weights(self, layer, input_size, output_partition_sizes, params_dtype):
        self.params_dtype = params_dtype
        # Sized once the checkpoint is read (the bytes per row depend on the type).
        layer.register_parameter(
            "qweight", nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        )
        types = torch.zeros(len(output_partition_sizes), dtype=torch.uint8)
        layer.register_parameter("qweight_type", nn.Parameter(types, requires_grad=False))
        layer.data_container = {}  # shard id -> that shard's bytes, until loading ends

    def weight_loader(self, layer, param_name, loaded, shard_id, ckpt_name):
        """``qweight_type``: the shard's type; ``qweight``: its bytes, rows checked."""
        index = layer.shard_ids.index(shard_id)
        if param_name == "qweight_type":
            layer.qweight_type.data[index] = int(loaded)
            return
        rows = layer.output_sizes[index]
        if loaded.dtype != torch.uint8 or loaded.dim() != 2 or loaded.shape[0] != rows:
            raise ValueError(
                f"checkpoint tensor {ckpt_name!r} must be uint8 GGUF bytes with {rows} rows, "
                f"got {loaded.dtype} {list(loaded.shape)}"
            )
        layer.data_container[shard_id] = loaded.to(layer.qweight_type.device)

    def process_weights_after_loading(self, layer):
        types = layer.qweight_type.tolist()
        for shard_id, qweight_type in zip(layer.shard_ids, types, strict=True):
            if qweight_type not in DEQUANT_TYPES:
                name = WeightType(qweight_type).name
                raise ValueError(
                    f"Unsupported GGUF quantization type {name} in layer {layer.prefix}."
                )
            _, type_size = gguf.GGML_QUANT_SIZES[WeightType(qweight_type)]
            expected = layer.input_size // 32 * type_size
            if layer.data_container[shard_id].shape[1] != expected:
                raise ValueError(
                    f"{layer.prefix}: {WeightType(qweight_type).name} bytes for "
                    f"{layer.input_size} inputs must be {expected} a row, got "
                    f"{layer.data_container[shard_id].shape[1]}"
                )
        self._create_padded_weight_param(layer)

    def _create_padded_weight_param(self, layer):
        """The shards' bytes stacked into one ``qweight``, each row padded to the widest."""
        shards = [layer.data_container[shard_id] for shard_id in layer.shard_ids]
        width = max(s.shape[1] for s in shards)
        qweight = torch.zeros(sum(layer.output_sizes), width, dtype=torch.uint8)
        layer.shard_offset_map = {}  # shard id -> (first row, end row, bytes a row)
        start = 0
        for shard_id, data in zip(layer.shard_ids, shards, strict=True):
            end = start + data.shape[0]
            qweight[start:end, : data.shape[1]] = data
            layer.shard_offset_map[shard_id] = (start, end, data.shape[1])
            start = end
        layer.qweight = nn.Parameter(qweight.to(layer.qweight_type.device), requires_grad=False)
        layer.data_container.clear()

    # BEGIN LAB 10.4: the whole weight of a (fused) layer, shard by shard
    def dequantized_weight(self, layer, dtype: torch.dtype) -> torch.Tensor:
        """The whole [out, in] weight, shard by shard."""
        # HINT: layer.shard_offset_map[shard_id] is (first row, end row, bytes a row) of
        # HINT: that shard in layer.qweight (rows padded to the widest shard: slice them).
        # HINT: layer.qweight_type holds each shard's type, in layer.shard_ids order.
        parts = []
        types = layer.qweight_type.tolist()
        for shard_id, qweight_type in zip(layer.shard_ids, types, strict=True):
            start, end, width = layer.shard_offset_map[shard_id]
            part = layer.qweight[start:end, :width]
            parts.append(ggml_dequantize(part, qweight_type, end - start, layer.input_size, dtype))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    # END LAB 10.4

    def apply(self, layer, x, bias=None):
        return F.linear(x, self.dequantized_weight(layer, x.dtype), bias)


class GGUFEmbeddingMethod(GGUFLinearMethod):
    """A GGUF embedding table: rows dequantized as they are looked up."""

    # BEGIN LAB 10.4: an embedding lookup that dequantizes only the rows it reads
    def embedding(self, layer, input_):
        """``input_`` token ids (any shape) -> their rows, dequantized, in ``params_dtype``."""
        # HINT: the table is one shard (shard id None); pick the rows' bytes first
        # HINT: (index_select), then dequantize just those rows.
        qweight_type = int(layer.qweight_type[0])
        _, _, width = layer.shard_offset_map[None]
        rows = layer.qweight[:, :width].index_select(0, input_.flatten())
        out = ggml_dequantize(
            rows, qweight_type, rows.shape[0], layer.input_size, self.params_dtype
        )
        return out.view(*input_.shape, layer.input_size)

    # END LAB 10.4
