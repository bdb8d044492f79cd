"""How well the drafts did, one engine step at a time.

Mirrors upstream ``vllm/v1/spec_decode/metrics.py`` (``SpecDecodingStats``
:18) at v0.22.1: the scheduler fills one per step in ``update_from_output``
(one ``observe_draft`` per request that had drafts scheduled) and hands it
out in ``SchedulerStats.spec_decoding_stats``. Left out: the interval logger
and the Prometheus counters (UPSTREAM_PIN.md).

Invariants: ``num_accepted_tokens <= num_draft_tokens``; position ``i`` of
``num_accepted_tokens_per_pos`` counts the drafts whose first ``i + 1``
tokens were all accepted, so it never increases with ``i``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [num_spec_tokens]

    @classmethod
    def new(cls, num_spec_tokens: int) -> SpecDecodingStats:
        return cls(
            num_spec_tokens=num_spec_tokens, num_accepted_tokens_per_pos=[0] * num_spec_tokens
        )

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request's verified draft: ``num_accepted_tokens`` of its
        ``num_draft_tokens`` were kept (a prefix: acceptance stops at the
        first rejection)."""
        assert num_accepted_tokens <= self.num_spec_tokens
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for pos in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[pos] += 1
