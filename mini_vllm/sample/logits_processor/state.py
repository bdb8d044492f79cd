"""Collecting one step's batch changes, and the processors grouped for the sampler.

Mirrors upstream ``vllm/v1/sample/logits_processor/state.py`` at v0.22.1:
``BatchUpdateBuilder`` :18 and ``LogitsProcessors`` :148.

The persistent batch records a step's changes in a ``BatchUpdateBuilder``:
all removals first (``removed_append``), then additions, which take the
lowest removed rows first (``pop_removed``), then the condense moves and
swaps. ``get_and_reset`` hands the processors one frozen ``BatchUpdate`` (or
None if nothing changed) and starts the next step empty.

Invariants: once ``removed`` has been read in a step it is sorted in
descending order (lowest row last) and no more removals may be registered
until the next ``reset`` / ``get_and_reset``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import chain

from mini_vllm.sample.logits_processor.interface import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    MovedRequest,
    RemovedRequest,
)


class BatchUpdateBuilder:
    def __init__(
        self,
        removed: list[RemovedRequest] | None = None,
        added: list[AddedRequest] | None = None,
        moved: list[MovedRequest] | None = None,
    ) -> None:
        self._removed = removed or []
        self.added = added or []
        self.moved = moved or []
        self._is_removed_sorted = False
        # Set by any change, including ones the lists do not record.
        self.batch_changed = False

    @property
    def removed(self) -> list[RemovedRequest]:
        """The removed rows, in descending order."""
        if not self._is_removed_sorted:
            self._removed.sort(reverse=True)
            self._is_removed_sorted = True
        return self._removed

    def removed_append(self, index: int) -> None:
        if self._is_removed_sorted:
            raise RuntimeError(
                "Cannot register a removed request after `removed` was read this step."
            )
        self._removed.append(index)
        self.batch_changed = True

    def has_removed(self) -> bool:
        return bool(self._removed)

    def peek_removed(self) -> int | None:
        """The lowest removed row, or None."""
        return self.removed[-1] if self._removed else None

    def pop_removed(self) -> int | None:
        """Take the lowest removed row (a new request will fill it), or None."""
        return self.removed.pop() if self._removed else None

    def reset(self) -> bool:
        """Drop this step's records; return whether the batch changed."""
        self._is_removed_sorted = False
        self._removed.clear()
        self.added.clear()
        self.moved.clear()
        changed, self.batch_changed = self.batch_changed, False
        return changed

    def get_and_reset(self, batch_size: int) -> BatchUpdate | None:
        """This step's changes as a BatchUpdate (None if there were none); start anew."""
        self._is_removed_sorted = False
        self.batch_changed = False
        if not (self._removed or self.added or self.moved):
            return None
        update = BatchUpdate(
            batch_size=batch_size, removed=self._removed, added=self.added, moved=self.moved
        )
        self._removed, self.added, self.moved = [], [], []
        return update


class LogitsProcessors:
    """The batch's processors, split by whether they can change a greedy pick."""

    def __init__(self, logitsprocs: Iterable[LogitsProcessor] | None = None) -> None:
        self.argmax_invariant: list[LogitsProcessor] = []
        self.non_argmax_invariant: list[LogitsProcessor] = []
        for proc in logitsprocs or ():
            group = (
                self.argmax_invariant if proc.is_argmax_invariant() else self.non_argmax_invariant
            )
            group.append(proc)

    @property
    def all(self) -> Iterator[LogitsProcessor]:
        return chain(self.argmax_invariant, self.non_argmax_invariant)
