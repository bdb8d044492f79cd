"""The encoder cache's bookkeeping, and the encoder budgets of a multimodal model.

Mirrors upstream ``vllm/v1/core/encoder_cache_manager.py`` at v0.22.1
(``EncoderCacheManager`` at :17, ``compute_mm_encoder_budget`` at :269). The
scheduler owns this manager; the runner owns the tensors. Each step the
scheduler tells the runner which items to encode (``scheduled_encoder_inputs``)
and which cached outputs it may drop (``free_encoder_mm_hashes``).
Left out: ``EncoderDecoderCacheManager`` (encoder-decoder models) and the
warning logged for a model with every modality disabled.

Invariants kept:
- entries are keyed by the item's ``identifier`` (its hash), so requests
  with the same image share one entry and one encoder run;
- everything is counted in encoder embeddings, not placeholder tokens;
- ``0 <= num_free_slots <= num_freeable_slots <= cache_size``: freeable
  slots are the free ones plus those of entries no request references;
- an unreferenced entry stays cached (and can be hit again) until space is
  needed; then the oldest such entries are evicted first, and their hashes
  are reported once through ``get_freed_mm_hashes``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mini_vllm.config import SchedulerConfig
    from mini_vllm.request import Request


class EncoderCacheManager:
    def __init__(self, cache_size: int) -> None:
        """``cache_size``: how many encoder embeddings the runner's cache holds."""
        self.cache_size = cache_size
        self.num_free_slots = cache_size
        self.num_freeable_slots = cache_size
        # identifier -> ids of the requests that reference the entry (empty:
        # cached, but evictable).
        self.cached: dict[str, set[str]] = {}
        # identifier -> its embeddings, for unreferenced entries, oldest first.
        self.freeable: OrderedDict[str, int] = OrderedDict()
        # Identifiers evicted since the last get_freed_mm_hashes().
        self.freed: list[str] = []

    def reset(self) -> None:
        """Forget every entry (upstream calls it when the weights change)."""
        self.cached.clear()
        self.freeable.clear()
        self.freed.clear()
        self.num_free_slots = self.cache_size
        self.num_freeable_slots = self.cache_size

    # BEGIN LAB 13.2: a cache hit: the request now references the entry
    def check_and_update_cache(self, request: Request, input_id: int) -> bool:
        """Whether item ``input_id``'s encoder output is cached; if so, the
        request now references it (an unreferenced entry stops being freeable)."""
        # HINT: the key is request.mm_features[input_id].identifier. self.cached maps it
        # HINT: to the ids of the requests referencing it; an empty set means unreferenced:
        # HINT: the entry is in self.freeable and its embeddings count in num_freeable_slots.
        mm_hash = request.mm_features[input_id].identifier
        if mm_hash not in self.cached:
            return False
        if not self.cached[mm_hash]:
            self.num_freeable_slots -= self.freeable.pop(mm_hash)
        self.cached[mm_hash].add(request.request_id)
        return True

    # END LAB 13.2

    # BEGIN LAB 13.2: room in the budget and the cache, evicting unreferenced entries
    def can_allocate(
        self,
        request: Request,
        input_id: int,
        encoder_compute_budget: int,
        num_embeds_to_schedule: int,
    ) -> bool:
        """Whether item ``input_id`` can be encoded this step.

        False if its embeddings exceed the compute budget left, or if they and
        the ``num_embeds_to_schedule`` already promised this step exceed the
        free plus freeable slots. When free slots alone are short, the oldest
        unreferenced entries are evicted (into ``freed``) until they suffice.
        """
        # HINT: request.get_num_encoder_embeds(input_id) is the item's size. Evict from the
        # HINT: front of self.freeable (oldest first): drop the entry from self.cached, note
        # HINT: its hash in self.freed, give its embeddings back to num_free_slots.
        num_embeds = request.get_num_encoder_embeds(input_id)
        if num_embeds > encoder_compute_budget:
            return False
        num_embeds += num_embeds_to_schedule
        if num_embeds <= self.num_free_slots:
            return True
        if num_embeds > self.num_freeable_slots:
            return False
        while num_embeds > self.num_free_slots:
            mm_hash, num_evicted = self.freeable.popitem(last=False)
            del self.cached[mm_hash]
            self.freed.append(mm_hash)
            self.num_free_slots += num_evicted
        return True

    # END LAB 13.2

    # BEGIN LAB 13.2: reserve an entry for an item about to be encoded
    def allocate(self, request: Request, input_id: int) -> None:
        """Reserve room for item ``input_id``'s output, referenced by the request
        (after ``can_allocate`` said yes)."""
        # HINT: the entry is referenced at once; it takes free and freeable slots alike.
        mm_hash = request.mm_features[input_id].identifier
        num_embeds = request.get_num_encoder_embeds(input_id)
        assert self.num_free_slots >= num_embeds
        assert self.num_freeable_slots >= num_embeds
        self.cached.setdefault(mm_hash, set()).add(request.request_id)
        self.num_free_slots -= num_embeds
        self.num_freeable_slots -= num_embeds

    # END LAB 13.2

    def get_cached_input_ids(self, request: Request) -> set[int]:
        """The request's items whose identifier has an entry (referenced or not)."""
        return {
            i for i, feature in enumerate(request.mm_features) if feature.identifier in self.cached
        }

    # BEGIN LAB 13.2: drop one reference; the last one makes the entry freeable
    def free_encoder_input(self, request: Request, input_id: int) -> None:
        """Drop the request's reference to item ``input_id``; an entry no one
        references becomes freeable (it stays cached until space is needed)."""
        # HINT: nothing to do if the entry is absent or already unreferenced. A freeable
        # HINT: entry goes to the back of self.freeable (evicted last) with its size.
        mm_hash = request.mm_features[input_id].identifier
        if not self.cached.get(mm_hash):
            return
        self.cached[mm_hash].discard(request.request_id)
        if not self.cached[mm_hash]:
            num_embeds = request.get_num_encoder_embeds(input_id)
            self.freeable[mm_hash] = num_embeds
            self.num_freeable_slots += num_embeds

    # END LAB 13.2

    def free(self, request: Request) -> None:
        """Drop every reference the request holds (it finished or was preempted)."""
        for input_id in self.get_cached_input_ids(request):
            self.free_encoder_input(request, input_id)

    # BEGIN LAB 13.2: the evicted hashes, reported once
    def get_freed_mm_hashes(self) -> list[str]:
        """The identifiers evicted since the last call (the runner drops their
        outputs); the list starts over."""
        # HINT: hand over self.freed and start a new, empty list.
        freed, self.freed = self.freed, []
        return freed

    # END LAB 13.2


def compute_mm_encoder_budget(
    scheduler_config: SchedulerConfig, mm_max_toks_per_item: Mapping[str, int]
) -> tuple[int, int]:
    """(encoder compute budget per step, encoder cache size), in embeddings.

    ``mm_max_toks_per_item``: the most embeddings one item of each modality
    can have (the model's processor knows). Both budgets are at least that, so
    the largest item always fits; with no modality, both are 0.
    """
    if not mm_max_toks_per_item:
        return 0, 0
    max_tokens_per_mm_item = max(mm_max_toks_per_item.values())
    if (
        scheduler_config.disable_chunked_mm_input
        and max_tokens_per_mm_item > scheduler_config.max_num_batched_tokens
    ):
        raise ValueError(
            f"disable_chunked_mm_input is set but one multimodal item can take "
            f"{max_tokens_per_mm_item} tokens, more than max_num_batched_tokens "
            f"({scheduler_config.max_num_batched_tokens}): increase max_num_batched_tokens."
        )
    encoder_compute_budget = max(
        scheduler_config.max_num_encoder_input_tokens, max_tokens_per_mm_item
    )
    encoder_cache_size = max(scheduler_config.encoder_cache_size, max_tokens_per_mm_item)
    return encoder_compute_budget, encoder_cache_size
