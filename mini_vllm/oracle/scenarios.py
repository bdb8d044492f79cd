"""Named scheduler scenarios recorded from upstream as snapshots.

Each one isolates a rule a student must get right; together they cover
chunked prefill, prefix caching, both preemption policies, the admission
gates, stop conditions and aborts. Prompts are built from small patterns so
a reader can follow the block ids in the recorded JSON by hand.

``SPEC_SCENARIOS`` run with n-gram speculation (``num_speculative_tokens``):
the driver's fake drafter and fake verifier (``mini_vllm.oracle.workload``)
supply the drafts and how many are accepted. They are recorded beside the
others but kept apart, since only the scheduler takes part in them (the
model-runner oracles replay ``SCENARIOS`` alone).
"""

from __future__ import annotations

from mini_vllm.oracle.workload import RequestSpec, Workload


def _prompt(tag: int, n: int) -> list[int]:
    return [100 * tag + (i % 100) for i in range(n)]


SHARED = [7] * 32  # two blocks of 16

# A long prompt ("b") whose first chunk fits in free blocks but whose whole
# prompt does not, while "a" keeps growing: the full-prompt admission gate
# (scheduler_reserve_full_isl) decides whether "b" may start.
GATE_REQUESTS = [
    RequestSpec("a", _prompt(1, 40), max_tokens=30, ignore_eos=True),
    RequestSpec("b", _prompt(2, 100), max_tokens=3),
    RequestSpec("c", _prompt(3, 12), max_tokens=3),
]


SCENARIOS: list[Workload] = [
    Workload(
        "chunked_prefill",
        dict(
            block_size=16,
            num_blocks=64,
            max_num_batched_tokens=48,
            max_num_seqs=4,
            max_model_len=256,
        ),
        [
            RequestSpec("a", _prompt(1, 100), max_tokens=4),
            RequestSpec("b", _prompt(2, 30), max_tokens=6),
            RequestSpec("c", _prompt(3, 70), max_tokens=3, arrive_step=2),
        ],
    ),
    Workload(
        "no_chunked_prefill",
        dict(
            block_size=16,
            num_blocks=64,
            max_num_batched_tokens=128,
            max_num_seqs=4,
            max_model_len=128,
            enable_chunked_prefill=False,
        ),
        [
            RequestSpec("a", _prompt(1, 100), max_tokens=3),
            RequestSpec("b", _prompt(2, 60), max_tokens=3),
            RequestSpec("c", _prompt(3, 20), max_tokens=3),
        ],
    ),
    Workload(
        "long_prefill_threshold",
        dict(
            block_size=8,
            num_blocks=64,
            max_num_batched_tokens=64,
            max_num_seqs=4,
            max_model_len=128,
            long_prefill_token_threshold=12,
        ),
        [
            RequestSpec("a", _prompt(1, 50), max_tokens=3),
            RequestSpec("b", _prompt(2, 9), max_tokens=3),
            RequestSpec("c", _prompt(3, 30), max_tokens=3),
        ],
    ),
    Workload(
        "prefix_cache_hits",
        dict(
            block_size=16,
            num_blocks=40,
            max_num_batched_tokens=256,
            max_num_seqs=8,
            max_model_len=256,
        ),
        [
            RequestSpec("a", SHARED + _prompt(1, 10), max_tokens=5),
            RequestSpec("b", SHARED + _prompt(2, 20), max_tokens=5),
            RequestSpec("c", SHARED + _prompt(3, 5), max_tokens=5, arrive_step=3),
            # Exactly two full blocks: at most one may hit (the last token is recomputed).
            RequestSpec("d", list(SHARED), max_tokens=5, arrive_step=4),
        ],
    ),
    Workload(
        "prefix_cache_off",
        dict(
            block_size=16,
            num_blocks=40,
            max_num_batched_tokens=256,
            max_num_seqs=8,
            max_model_len=256,
            enable_prefix_caching=False,
        ),
        [
            RequestSpec("a", SHARED + _prompt(1, 10), max_tokens=5),
            RequestSpec("b", SHARED + _prompt(2, 20), max_tokens=5, arrive_step=2),
        ],
    ),
    Workload(
        "preemption_fcfs",
        dict(
            block_size=4, num_blocks=17, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64
        ),
        [
            RequestSpec(f"r{i}", _prompt(i, 10 + 3 * i), max_tokens=20, ignore_eos=True)
            for i in range(5)
        ],
    ),
    Workload(
        "preemption_priority",
        dict(
            block_size=4,
            num_blocks=17,
            max_num_batched_tokens=64,
            max_num_seqs=8,
            max_model_len=64,
            policy="priority",
        ),
        [
            RequestSpec(
                f"r{i}",
                _prompt(i, 10 + 3 * i),
                max_tokens=20,
                ignore_eos=True,
                priority=p,
                arrive_step=i // 2,
            )
            for i, p in enumerate([2, 0, 3, 1, 0])
        ],
    ),
    Workload(
        "admission_gates",
        # max_num_seqs caps the batch; the full-prompt gate holds back a long
        # prompt that would not fit whole even though its first chunk would.
        dict(
            block_size=8,
            num_blocks=16,
            max_num_batched_tokens=32,
            max_num_seqs=2,
            max_model_len=104,
        ),
        GATE_REQUESTS,
    ),
    Workload(
        "admission_without_full_prompt_gate",
        dict(
            block_size=8,
            num_blocks=16,
            max_num_batched_tokens=32,
            max_num_seqs=2,
            max_model_len=104,
            scheduler_reserve_full_isl=False,
        ),
        GATE_REQUESTS,
    ),
    Workload(
        "stop_conditions",
        dict(
            block_size=4, num_blocks=64, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=40
        ),
        [
            RequestSpec("eos", _prompt(1, 6), max_tokens=10, eos_at=2),
            RequestSpec("eos_ignored", _prompt(2, 6), max_tokens=5, eos_at=1, ignore_eos=True),
            RequestSpec(
                "eos_before_min_tokens", _prompt(3, 6), max_tokens=10, eos_at=1, min_tokens=3
            ),
            RequestSpec(
                "stop_token", _prompt(4, 6), max_tokens=10, stop_token_ids=[7, 9], stop_at=3
            ),
            RequestSpec("max_tokens", _prompt(5, 6), max_tokens=4),
            RequestSpec("max_model_len", _prompt(6, 30), max_tokens=50),
        ],
    ),
    Workload(
        "aborts",
        dict(
            block_size=8,
            num_blocks=40,
            max_num_batched_tokens=32,
            max_num_seqs=2,
            max_model_len=128,
        ),
        [
            RequestSpec("running", _prompt(1, 20), max_tokens=10, abort_step=3),
            RequestSpec("mid_prefill", _prompt(2, 60), max_tokens=10, abort_step=1),
            RequestSpec("waiting", _prompt(3, 20), max_tokens=10, abort_step=2),
            RequestSpec("survivor", _prompt(4, 20), max_tokens=6),
        ],
    ),
]


SPEC_SCENARIOS: list[Workload] = [
    Workload(
        # Drafts of 3 with 3, 0, 1, 2 accepted in turn: the rollback of each
        # rejected draft and the per-position acceptance counts.
        "spec_accept_and_reject",
        dict(
            block_size=4,
            num_blocks=64,
            max_num_batched_tokens=64,
            max_num_seqs=4,
            max_model_len=64,
            num_speculative_tokens=3,
        ),
        [
            RequestSpec(
                "a",
                _prompt(1, 6),
                max_tokens=16,
                ignore_eos=True,
                draft_lens=[3],
                accepted=[3, 0, 1, 2],
            ),
            RequestSpec(
                "b",
                _prompt(2, 9),
                max_tokens=12,
                ignore_eos=True,
                draft_lens=[3, 1, 0],
                accepted=[1],
            ),
        ],
    ),
    Workload(
        # A budget of 8 tokens for 3 decoding requests with 4 drafts each, and a
        # long-prefill threshold of 3: drafts are cut to what the budget leaves.
        "spec_budget_trims_drafts",
        dict(
            block_size=4,
            num_blocks=64,
            max_num_batched_tokens=8,
            max_num_seqs=4,
            max_model_len=64,
            num_speculative_tokens=4,
            long_prefill_token_threshold=3,
        ),
        [
            RequestSpec(
                f"r{i}",
                _prompt(i, 5),
                max_tokens=10,
                ignore_eos=True,
                draft_lens=[4],
                accepted=[4, 2],
            )
            for i in range(3)
        ],
    ),
    Workload(
        # A tight cache under PRIORITY: a request scheduled with drafts is
        # preempted later in the same step, and its drafts are dropped.
        "spec_preemption_priority",
        dict(
            block_size=4,
            num_blocks=17,
            max_num_batched_tokens=64,
            max_num_seqs=8,
            max_model_len=64,
            num_speculative_tokens=2,
            policy="priority",
        ),
        [
            RequestSpec(
                f"r{i}",
                _prompt(i, 10 + 3 * i),
                max_tokens=20,
                ignore_eos=True,
                priority=p,
                arrive_step=i,
                draft_lens=[2],
                accepted=[2, 1, 0],
            )
            # Later arrivals have better priorities, so they preempt requests
            # that sit earlier in the running list and were already scheduled.
            for i, p in enumerate([3, 2, 1, 0, 0])
        ],
    ),
    Workload(
        # EOS and a stop token inside accepted drafts end the request there;
        # near max_model_len the drafts are cut so no position reaches it.
        "spec_stops_inside_drafts",
        dict(
            block_size=4,
            num_blocks=64,
            max_num_batched_tokens=64,
            max_num_seqs=4,
            max_model_len=24,
            num_speculative_tokens=5,
        ),
        [
            RequestSpec(
                "eos", _prompt(1, 6), max_tokens=20, eos_at=4, draft_lens=[5], accepted=[5]
            ),
            RequestSpec(
                "stop",
                _prompt(2, 6),
                max_tokens=20,
                stop_token_ids=[7],
                stop_at=3,
                draft_lens=[5],
                accepted=[5],
            ),
            RequestSpec(
                "model_len",
                _prompt(3, 16),
                max_tokens=20,
                ignore_eos=True,
                draft_lens=[5],
                accepted=[5],
            ),
        ],
    ),
]


def get_scenario(name: str) -> Workload:
    for workload in SCENARIOS + SPEC_SCENARIOS:
        if workload.name == name:
            return workload
    known = [w.name for w in SCENARIOS + SPEC_SCENARIOS]
    raise KeyError(f"no scenario named {name!r}; known: {known}")
