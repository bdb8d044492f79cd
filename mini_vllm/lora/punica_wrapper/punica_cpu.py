"""Applies every row's adapter to a linear layer's output, for a whole batch.

Mirrors upstream ``vllm/lora/punica_wrapper/punica_cpu.py`` at v0.22.1
(``PunicaWrapperCPU`` :22: ``add_shrink`` :166, ``add_expand`` :197,
``add_lora_linear`` :265) with the metadata upstream's
``PunicaWrapperBase._update_prefill_metadata`` builds
(vllm/lora/punica_wrapper/punica_base.py:204). Upstream's runner sets ``is_prefill``
on every platform but CUDA (vllm/v1/worker/lora_model_runner_mixin.py:64),
so its CPU wrapper always runs the SGMV ops; so does this one.
Left out: embeddings and logits with LoRA, the decode (BGMV) path, the
preallocated index buffers.

Slot -1 (a row with no adapter) indexes the last slot of the stacked
weights, as torch indexing does. Upstream's layers have no spare slot, so on
a CPU such a row beside adapter rows gets whatever adapter weights the last
slot holds (run in tests/upstream/test_lora_ops_oracle.py); mini_vllm's LoRA
layers keep one extra slot, always zero, at the end, so here it adds nothing
(UPSTREAM_PIN.md, Phase 11).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mini_vllm.lora.ops.torch_ops.lora_ops import sgmv_expand_slice, sgmv_shrink
from mini_vllm.lora.punica_wrapper.utils import compute_meta, token_lora_indices


class PunicaWrapperCPU:
    def __init__(self) -> None:
        self.token_lora_tensor = torch.empty(0, dtype=torch.long)
        self.prefill_metadata: tuple = ()
        self.no_lora = True

    def update_metadata(
        self, token_lora_mapping: Sequence[int], lora_index_to_id: Sequence[int | None]
    ) -> None:
        """This step's rows: each token's adapter id (0: none) and the slot order."""
        self.token_lora_tensor = token_lora_indices(token_lora_mapping, lora_index_to_id)
        if not len(token_lora_mapping):
            self.no_lora = True
            return
        starts, lengths, slots, batches, max_len, tokens, self.no_lora = compute_meta(
            self.token_lora_tensor
        )
        self.prefill_metadata = (starts, lengths, slots, batches, max_len, tokens)

    # BEGIN LAB 11.4: shrink every slice, one SGMV call each
    def add_shrink(
        self,
        y: tuple[torch.Tensor, ...],
        x: torch.Tensor,
        lora_a_stacked: tuple[torch.Tensor, ...],
        scale: float,
    ) -> None:
        """``y[i] = (x @ lora_a[slot].T) * scale`` for each slice i."""
        # HINT: nothing when no_lora. Flatten x to 2-D, then per slice sgmv_shrink(x, its
        # HINT: lora_a, its output buffer, *self.prefill_metadata, scale).
        if self.no_lora:
            return
        x = x.view(-1, x.shape[-1])
        for out, lora_a in zip(y, lora_a_stacked, strict=True):
            sgmv_shrink(x, lora_a, out, *self.prefill_metadata, scale)

    # END LAB 11.4

    # BEGIN LAB 11.4: expand every slice into its columns of y
    def add_expand(
        self,
        y: torch.Tensor,
        x: tuple[torch.Tensor, ...],
        lora_b_stacked: tuple[torch.Tensor, ...],
        output_slices: tuple[int, ...],
        offset_start: int = 0,
        add_inputs: bool = True,
    ) -> None:
        """``y[:, offset : offset + size] += x[i] @ lora_b[slot].T``, slice after slice."""
        # HINT: nothing when no_lora. Slice i goes to columns offset : offset + size of y
        # HINT: (flattened to 2-D), offset starting at offset_start and moving on by each
        # HINT: slice's size: sgmv_expand_slice with the prefill metadata.
        if self.no_lora:
            return
        flat = y.view(-1, y.shape[-1])
        offset = offset_start
        for shrunk, lora_b, size in zip(x, lora_b_stacked, output_slices, strict=True):
            sgmv_expand_slice(
                shrunk, lora_b, flat, *self.prefill_metadata, offset, size, add_inputs
            )
            offset += size

    # END LAB 11.4

    # BEGIN LAB 11.4: shrink into float32 buffers, then expand into the output
    def add_lora_linear(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: tuple[torch.Tensor, ...],
        lora_b_stacked: tuple[torch.Tensor, ...],
        scale: float,
        output_slices: tuple[int, ...],
    ) -> None:
        """Shrink into float32 buffers of the adapters' rank, then expand into
        ``y`` (the base layer's output, changed in place)."""
        # HINT: nothing when no_lora. One float32 zero buffer (rows, rank) per slice, rank
        # HINT: the stacks' (lora_b's last axis); add_shrink into them, then add_expand into
        # HINT: y with add_inputs=True.
        if self.no_lora:
            return
        rank = lora_b_stacked[0].size(-1)
        buffer = tuple(
            torch.zeros((x.size(0), rank), dtype=torch.float32, device=x.device)
            for _ in output_slices
        )
        self.add_shrink(buffer, x, lora_a_stacked, scale)
        self.add_expand(y, buffer, lora_b_stacked, output_slices, add_inputs=True)

    # END LAB 11.4
