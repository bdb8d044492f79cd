"""The LoRA matmuls of a mixed batch, in plain torch: shrink and expand.

Mirrors upstream ``vllm/lora/ops/torch_ops/lora_ops.py`` at v0.22.1
(``sgmv_expand`` :7, ``bgmv_expand`` :24, ``sgmv_shrink`` :50,
``bgmv_shrink`` :67, ``sgmv_expand_slice`` :83, ``bgmv_expand_slice`` :110),
the reference upstream's Triton and punica kernels are checked against.
Left out: nothing; the arguments the GPU kernels need and the torch versions
ignore (``batches``, ``max_seq_length``, ``token_nums``) are kept, so the
signatures match.

A LoRA layer keeps every loaded adapter's matrices stacked by slot:
``lora_a`` (slots, rank, in) and ``lora_b`` (slots, out, rank), optionally
with a size-1 axis after the slot, as upstream stacks them. One batch row
``x[i]`` runs ``x[i] @ lora_a[idx[i]].T`` (shrink, to rank numbers, times the
adapter's scaling) and then ``@ lora_b[idx[i]].T`` (expand, added into the
base layer's output). BGMV ("batched gather matrix-vector") takes one slot
index per row (decode rows); SGMV ("segmented") takes one per segment of
consecutive rows (a prefill chunk of one request) and repeats it over the
segment's length. Each gathers every row's matrices, which costs memory in
proportion to the rows: the GPU kernels do the same in tiles.
"""

from __future__ import annotations

import torch


def _gather(weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each row's (out, in) matrix, from stacked slots (slots, [1,] out, in)."""
    selected = weights[indices].to(dtype=dtype)
    if selected.dim() == 4:
        selected = selected.squeeze(1)
    return selected


# BEGIN LAB 11.2: BGMV shrink: each row times its adapter's lora_a, scaled
def bgmv_shrink(
    inputs: torch.Tensor,
    lora_a_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    scaling: float = 1.0,
) -> None:
    """``output[i, :rank] = scaling * lora_a[idx[i]] @ inputs[i]`` (overwrites)."""
    # HINT: gather each row's lora_a (_gather drops the size-1 axis and casts to the
    # HINT: output's dtype), contract over the input features (einsum "ti,tri->tr"),
    # HINT: scale, and overwrite the first rank columns of output_tensor.
    matrices = _gather(lora_a_weights, lora_indices_tensor, output_tensor.dtype)
    shrunk = torch.einsum("ti,tri->tr", inputs.to(output_tensor.dtype), matrices)
    output_tensor[:, : shrunk.shape[1]] = scaling * shrunk


# END LAB 11.2


# BEGIN LAB 11.2: BGMV expand: each row's rank numbers times its adapter's lora_b
def bgmv_expand(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    add_inputs: bool = True,
) -> None:
    """``output[i] (+)= lora_b[idx[i]] @ inputs[i]``, over the columns both have
    (an adapter and the model may pad the output differently)."""
    # HINT: gather each row's lora_b, contract over the rank ("tr,tor->to"), and
    # HINT: add (add_inputs) or write into the first min(its width, the output's) columns.
    # HINT: Upstream's edge case: one result row against several output rows fills only
    # HINT: the first output row.
    matrices = _gather(lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    expanded = torch.einsum("tr,tor->to", inputs.to(output_tensor.dtype), matrices)
    # As upstream: a single result row against many output rows fills only the first.
    rows = output_tensor.shape[0]
    if expanded.shape[0] == 1 and rows != 1:
        rows = 1
    width = min(expanded.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :width] += expanded[:rows, :width]
    else:
        output_tensor[:, :width] = expanded[:rows, :width]


# END LAB 11.2


# BEGIN LAB 11.2: BGMV expand into one slice of the output's columns
def bgmv_expand_slice(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = True,
) -> None:
    """As ``bgmv_expand``, into columns ``slice_offset : slice_offset + slice_size``
    (one of q/k/v, or gate/up, of a merged projection)."""
    # HINT: as bgmv_expand, but into columns slice_offset : slice_offset + slice_size.
    matrices = _gather(lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    expanded = torch.einsum("tr,tor->to", inputs.to(output_tensor.dtype), matrices)
    columns = slice(slice_offset, slice_offset + slice_size)
    if add_inputs:
        output_tensor[:, columns] += expanded
    else:
        output_tensor[:, columns] = expanded


# END LAB 11.2


def _explode(lora_indices_tensor: torch.Tensor, seq_len_tensor: torch.Tensor) -> torch.Tensor:
    """One slot index per row: each segment's index repeated over its length."""
    return torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)


# BEGIN LAB 11.2: SGMV shrink: one slot index per segment of rows
def sgmv_shrink(
    inputs: torch.Tensor,
    lora_a_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    b_seq_start_loc: torch.Tensor,
    seq_len_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    batches: int,
    max_seq_length: int,
    token_nums: int,
    scaling: float,
) -> None:
    """``bgmv_shrink`` with one slot index per segment of rows."""
    # HINT: each segment's slot index repeated over its length gives one index a row
    # HINT: (_explode); then it is bgmv_shrink. batches, max_seq_length, token_nums and
    # HINT: b_seq_start_loc are for the GPU kernels: unused here.
    indices = _explode(lora_indices_tensor, seq_len_tensor)
    bgmv_shrink(inputs, lora_a_weights, output_tensor, indices, scaling)


# END LAB 11.2


# BEGIN LAB 11.2: SGMV expand: one slot index per segment of rows
def sgmv_expand(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    b_seq_start_loc: torch.Tensor,
    seq_len_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    batches: int,
    max_seq_length: int,
    token_nums: int,
    add_inputs: bool = False,
) -> None:
    """``bgmv_expand`` with one slot index per segment of rows."""
    # HINT: one index a row (_explode), then bgmv_expand.
    indices = _explode(lora_indices_tensor, seq_len_tensor)
    bgmv_expand(inputs, lora_b_weights, output_tensor, indices, add_inputs)


# END LAB 11.2


# BEGIN LAB 11.2: SGMV expand into a slice, one slot index per segment
def sgmv_expand_slice(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    b_seq_start_loc: torch.Tensor,
    seq_len_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    batches: int,
    max_seq_length: int,
    token_nums: int,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = False,
) -> None:
    """``bgmv_expand_slice`` with one slot index per segment of rows."""
    # HINT: one index a row (_explode), then bgmv_expand_slice.
    indices = _explode(lora_indices_tensor, seq_len_tensor)
    bgmv_expand_slice(
        inputs, lora_b_weights, output_tensor, indices, slice_offset, slice_size, add_inputs
    )


# END LAB 11.2
