"""From a batch's per-token adapter ids to what the shrink/expand ops take.

Mirrors upstream ``vllm/lora/punica_wrapper/utils.py`` at v0.22.1
(``compute_meta`` :15; the index part of ``convert_mapping`` :54).
Left out: the embedding, sampler and logits indices (mini_vllm's adapters
touch only the linear layers), and extra vocabularies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def token_lora_indices(
    token_lora_mapping: Sequence[int], lora_index_to_id: Sequence[int | None]
) -> torch.Tensor:
    """Each token's slot: where its adapter id sits in ``lora_index_to_id``
    (the layers' slot order), or -1 for a token with no adapter (id 0)."""
    return torch.tensor(
        [lora_index_to_id.index(i) if i > 0 else -1 for i in token_lora_mapping],
        dtype=torch.long,
    )


def compute_meta(
    token_lora_tensor: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int, int, bool]:
    """The segments SGMV runs over: runs of consecutive tokens with one slot
    (two requests of one adapter side by side make one segment). Returns
    (segment starts, segment lengths, segment slots, number of segments,
    longest segment, tokens, no_lora), where ``no_lora`` says that the whole
    batch is one segment without an adapter, so the ops can be skipped."""
    slots, lengths = torch.unique_consecutive(token_lora_tensor, return_counts=True)
    starts = torch.zeros_like(lengths)
    starts[1:] = torch.cumsum(lengths, dim=0)[:-1]
    no_lora = slots.numel() == 1 and int(slots[0]) == -1
    return (
        starts,
        lengths,
        slots,
        slots.numel(),
        int(lengths.max()),
        int(lengths.sum()),
        no_lora,
    )
