"""The decode-first order of the persistent batch.

Mirrors upstream ``vllm/v1/attention/backends/utils.py``
(``reorder_batch_to_split_decodes_and_prefills`` :632) at v0.22.1. The model
runner calls it from ``_may_reorder_batch`` when the attention backend asks
for it (``AttentionImpl.reorder_batch_threshold``), after ``condense`` and
before ``refresh_metadata``.

Each row of the batch falls in one of four regions, by what it computes this
step (``num_computed_tokens`` is the count before the step):

0. decode: it has context, at most ``decode_threshold`` new tokens, and its
   prompt is done;
1. short extend: context, at most ``decode_threshold`` new tokens, prompt not
   done (the last small chunk of a chunked prefill);
2. long extend: context and more than ``decode_threshold`` new tokens;
3. prefill: no context yet (a first chunk).

Afterwards the rows are in region order 0, 1, 2, 3, so a backend can run one
kernel over the leading decode rows and another over the rest. Only rows
outside their region's range move, by ``swap_states`` along the cycles of the
permutation, so a batch that is already in order is left alone.
"""

from __future__ import annotations

import numpy as np


def reorder_batch_to_split_decodes_and_prefills(
    input_batch, scheduler_output, decode_threshold: int = 1
) -> bool:
    """Put the batch's rows in region order (decode, short extend, long extend,
    prefill); return whether any row moved."""
    req_ids = input_batch.req_ids
    num_reqs = len(req_ids)
    num_scheduled = np.array([scheduler_output.num_scheduled_tokens[r] for r in req_ids])
    num_computed = input_batch.num_computed_tokens_cpu[:num_reqs]
    num_prompt = input_batch.num_prompt_tokens[:num_reqs]

    # BEGIN LAB 05.4: each row's region: decode, short extend, long extend, prefill
    # HINT: receives num_scheduled, num_computed and num_prompt (one entry per row); leaves
    # HINT: region, an int array: 0 decode, 1 short extend, 2 long extend, 3 prefill.
    # HINT: No context yet (num_computed == 0) is a prefill, whatever else. With context: more
    # HINT: than decode_threshold new tokens is a long extend; at most that many is a decode
    # HINT: once the prompt is done (num_computed >= num_prompt), else a short extend.
    has_context = num_computed > 0
    few_tokens = num_scheduled <= decode_threshold
    prompt_done = num_computed >= num_prompt
    region = np.zeros(num_reqs, dtype=np.int32)  # decode unless below
    region[has_context & few_tokens & ~prompt_done] = 1
    region[has_context & ~few_tokens] = 2
    region[~has_context] = 3
    # END LAB 05.4

    # BEGIN LAB 05.4: move only the misplaced rows, along the cycles of the permutation
    # HINT: receives region; leaves the rows in region order, moved only by
    # HINT: input_batch.swap_states, and returns False at once if no row is misplaced.
    # HINT: Upstream's order of swaps: the rows whose region differs from the sorted regions'
    # HINT: are the misplaced ones; taken in region order (stable), the k-th of them belongs
    # HINT: at the k-th misplaced row. Follow each cycle: swap a row with its destination; the
    # HINT: destination is then final, and the row now holds the one that was there.
    # The region each row must hold once sorted: [0]*decodes + [1]*short ...
    wanted = np.sort(region, kind="stable")
    misplaced = np.flatnonzero(region != wanted)
    if misplaced.size == 0:
        return False
    # The misplaced rows, taken in region order (stable), fill the misplaced
    # slots in row order: the k-th of them goes to misplaced[k].
    sources = misplaced[np.argsort(region[misplaced], kind="stable")]
    destination = dict(zip(sources.tolist(), misplaced.tolist(), strict=True))

    # Follow each cycle of the permutation: after swap_states(row, goal) the
    # goal row is final, and ``row`` holds what was at ``goal``, which must go
    # on to that row's destination.
    for row in destination:
        goal = destination[row]
        while row != goal:
            input_batch.swap_states(row, goal)
            next_goal = destination[goal]
            destination[goal] = goal
            goal = next_goal
    # END LAB 05.4
    return True
