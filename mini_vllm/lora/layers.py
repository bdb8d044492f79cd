"""A linear layer that adds every row's LoRA adapter to its output.

Mirrors upstream ``vllm/lora/layers/base_linear.py`` at v0.22.1
(``BaseLinearLayerWithLoRA`` :69: ``create_lora_weights`` :99,
``reset_lora`` :152, ``set_lora`` :157, ``apply`` :185). Upstream has a
subclass a parallel linear (column, merged column, QKV, row,
vllm/lora/layers/column_parallel_linear.py and row_parallel_linear.py); here
one class serves them all, since every mini layer holds its whole weight:
``n_slices`` is the base layer's number of shards (3 for q/k/v, 2 for
gate/up, 1 otherwise). Left out: tensor parallelism, fully sharded LoRA.

Each shard keeps ``max_loras + 1`` slots of zero-padded matrices:
``lora_a_stacked[s]`` [slots, 1, max_lora_rank, in] and ``lora_b_stacked[s]``
[slots, 1, shard_out, max_lora_rank]. The last slot stays zero: a row with no
adapter (slot -1) adds nothing. Upstream stacks ``max_loras`` slots, so its
slot -1 reads the weights in its last slot (UPSTREAM_PIN.md, Phase 11).
"""

from __future__ import annotations

import torch
from torch import nn

from mini_vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU


class BaseLinearLayerWithLoRA(nn.Module):
    def __init__(self, base_layer: nn.Module) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.output_slices = tuple(base_layer.output_sizes)
        self.n_slices = len(self.output_slices)
        self.punica_wrapper: PunicaWrapperCPU | None = None

    def create_lora_weights(
        self, max_loras: int, max_lora_rank: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        slots, d_in = max_loras + 1, self.base_layer.input_size
        self.lora_a_stacked = tuple(
            torch.zeros(slots, 1, max_lora_rank, d_in, dtype=dtype, device=device)
            for _ in self.output_slices
        )
        self.lora_b_stacked = tuple(
            torch.zeros(slots, 1, size, max_lora_rank, dtype=dtype, device=device)
            for size in self.output_slices
        )

    def reset_lora(self, index: int) -> None:
        for a, b in zip(self.lora_a_stacked, self.lora_b_stacked, strict=True):
            a[index] = 0
            b[index] = 0

    # BEGIN LAB 11.4: one adapter's matrices into a slot, zero-padded to the stacks' rank
    def set_lora(
        self,
        index: int,
        lora_a: list[torch.Tensor | None],
        lora_b: list[torch.Tensor | None],
    ) -> None:
        """Slot ``index`` takes one adapter's matrices, per shard (None: that
        shard is not adapted), zero-padded to the stacks' rank."""
        # HINT: clear the slot first (reset_lora: a smaller rank, or a shard the adapter
        # HINT: skips, must leave zeros). Shard s: lora_a [r, in] fills the first r rows of
        # HINT: lora_a_stacked[s][index, 0]; lora_b [out, r] the first r columns of
        # HINT: lora_b_stacked[s][index, 0]. A None shard stays zero.
        self.reset_lora(index)
        for s, (a, b) in enumerate(zip(lora_a, lora_b, strict=True)):
            if a is None:
                continue
            self.lora_a_stacked[s][index, 0, : a.shape[0], :] = a
            self.lora_b_stacked[s][index, 0, :, : b.shape[1]] = b

    # END LAB 11.4

    # BEGIN LAB 11.4: the base layer's output, plus each row's adapter
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # HINT: the base layer first; then the punica wrapper adds every row's adapter into
        # HINT: that output in place (add_lora_linear, scale 1.0: the scaling is in lora_b).
        output = self.base_layer(x)
        self.punica_wrapper.add_lora_linear(
            output, x, self.lora_a_stacked, self.lora_b_stacked, 1.0, self.output_slices
        )
        return output

    # END LAB 11.4
