"""Where a multimodal item sits in the prompt, and the feature a request carries for it.

Mirrors upstream ``vllm/multimodal/inputs.py`` at v0.22.1 (``PlaceholderRange``
at :119, ``MultiModalFeatureSpec`` at :302). The scheduler and the encoder
cache read only ``identifier`` and ``mm_position``; ``data`` is whatever the
processor made for the model's encoder (upstream: a ``MultiModalKwargsItem``;
here a plain dict of tensors, or None).
Left out: the batched-tensor field machinery (``MultiModalFieldElem``,
``MultiModalKwargsItem``, ``gather_kwargs``) and ``extract_embeds_range``.

Invariants kept:
- a placeholder covers prompt positions ``[offset, offset + length)``;
- with ``is_embed`` (a bool mask of shape ``(length,)``) only the True
  positions take an encoder embedding; without it, all ``length`` do;
- encoder budgets and the encoder cache count embeddings, not placeholder tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch


@dataclass(frozen=True)
class PlaceholderRange:
    """An item's placeholder tokens in the prompt.

    Prompt ``AAAA BBBB describe both``: image A has ``PlaceholderRange(0, 4)``,
    image B ``PlaceholderRange(5, 4)``.
    """

    offset: int
    length: int
    is_embed: torch.Tensor | None = None

    @cached_property
    def embeds_cumsum(self) -> list[int] | None:
        """Running count of embedding positions (a list: cheap to index)."""
        if self.is_embed is None:
            return None
        return self.is_embed.cumsum(dim=0).tolist()

    def get_num_embeds(self) -> int:
        """How many encoder embeddings this item fills (its encoder output rows)."""
        if self.embeds_cumsum is None:
            return self.length
        return self.embeds_cumsum[-1] if self.embeds_cumsum else 0

    def get_embeds_indices_in_range(self, start_idx: int, end_idx: int) -> tuple[int, int]:
        """Encoder-output rows ``[start, end)`` for placeholder positions ``[start_idx, end_idx)``.

        Positions are relative to ``offset``. With ``is_embed = [F, T, F, T, T]``,
        positions 3..5 hold rows 1..3: ``(3, 5) -> (1, 3)``.
        """
        if self.embeds_cumsum is None:
            return start_idx, end_idx
        start = self.embeds_cumsum[start_idx - 1] if start_idx > 0 else 0
        end = self.embeds_cumsum[end_idx - 1] if end_idx > 0 else 0
        return start, end


@dataclass
class MultiModalFeatureSpec:
    """One multimodal item of a request: its data, where it goes, and its hash.

    A request with three images carries three of these, in prompt order.
    """

    data: Any
    """The processed inputs for the encoder (a dict of tensors), or None."""

    modality: str
    """``"image"`` (the one modality mini_vllm runs)."""

    identifier: str
    """The item's hash: the encoder-cache key, shared by every request with the
    same image, and what block hashes carry for the placeholder tokens."""

    mm_position: PlaceholderRange
    """The item's placeholder tokens in the prompt."""

    mm_hash: str | None = None
    """The processor-cache hash (upstream: ``identifier`` without a LoRA prefix)."""
