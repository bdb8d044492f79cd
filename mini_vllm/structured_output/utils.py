"""Apply a batch's grammar bitmask to its logits; a choice list as an EBNF grammar.

Mirrors upstream ``vllm/v1/structured_output/utils.py`` at v0.22.1
(``apply_grammar_bitmask`` :44, ``choice_as_grammar`` :451). Upstream hands
the unpacking to xgrammar's kernel (``xgr.apply_token_bitmask_inplace``);
mini_vllm unpacks the bits with torch, so the rule is on the page, and its
tests check the result against that kernel. Left out: the Outlines and Lark
helpers. See UPSTREAM_PIN.md.

The bitmask: int32 ``[rows, ceil(vocab / 32)]``; bit ``j % 32`` of word
``j // 32`` set means token ``j`` is allowed. A row of all ones (-1) allows
everything.

Invariants kept:
- the scheduler's rows come in scheduled order (``structured_output_request_ids``,
  one row per request plus one per scheduled draft); the runner's logits come
  in the persistent batch's order: each row goes to its request's logits rows;
- a disallowed token's logit becomes -inf; every other logit is unchanged,
  and rows of requests without a constraint are not touched.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from mini_vllm.core.sched.output import GrammarOutput, SchedulerOutput

# The 8 bits of every byte value, lowest first: bool [256, 8].
_BYTE_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()


# BEGIN LAB 12.3: unpack the int32 words into one bool per token
def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size]: which tokens each row allows.

    Each int32 word is read as its 4 bytes, lowest first (the machine is
    little-endian: x86 and ARM are), and each byte as its 8 bits, lowest
    first, by table lookup: token ``32 * w + 8 * b + i`` is bit ``i`` of byte
    ``b`` of word ``w``.
    """
    # HINT: _BYTE_BITS[v] is byte value v's 8 bits, lowest first. Tensor.view(torch.uint8)
    # HINT: reinterprets the words as bytes; the last word may run past vocab_size.
    rows = bitmask.shape[0]
    as_bytes = bitmask.contiguous().view(torch.uint8).long()  # [rows, words * 4]
    bits = _BYTE_BITS.to(bitmask.device)[as_bytes]  # bool [rows, words * 4, 8]
    return bits.view(rows, -1)[:, :vocab_size]  # bool [rows, vocab_size]


# END LAB 12.3


# BEGIN LAB 12.3: each bitmask row onto its request's logits rows
def apply_grammar_bitmask(
    scheduler_output: SchedulerOutput,
    grammar_output: GrammarOutput,
    input_batch,
    logits: torch.Tensor,
) -> None:
    """Set to -inf, in place, the logits the grammars disallow.

    ``logits``: float [num_logits, V], one row per request of the batch, or
    ``1 + drafts`` rows for a request verifying drafts (in the batch's order).
    """
    # HINT: bitmask rows follow grammar_output.structured_output_request_ids (scheduled
    # HINT: order); logits rows follow input_batch.req_ids, each request's drafts
    # HINT: pushing the later rows down. A request with no row in this batch is skipped.
    grammar_bitmask = grammar_output.grammar_bitmask  # int32 [num_so_rows, words]
    spec_tokens = scheduler_output.scheduled_spec_decode_tokens
    # Where each structured request's first logits row is in this batch.
    struct_out_req_ids = set(grammar_output.structured_output_request_ids)
    first_logit_index: dict[str, int] = {}
    offset = 0
    for batch_index, req_id in enumerate(input_batch.req_ids):
        if req_id in struct_out_req_ids:
            first_logit_index[req_id] = batch_index + offset
        offset += len(spec_tokens.get(req_id, ()))

    out_indices: list[int] = []  # logits rows, in the bitmask's row order
    bitmask_rows: list[int] = []
    cumulative_index = 0
    for req_id in grammar_output.structured_output_request_ids:
        num_rows = 1 + len(spec_tokens.get(req_id, ()))
        if (logit_index := first_logit_index.get(req_id)) is not None:
            out_indices.extend(range(logit_index, logit_index + num_rows))
            bitmask_rows.extend(range(cumulative_index, cumulative_index + num_rows))
        cumulative_index += num_rows
    if not out_indices:
        return

    vocab_size = min(logits.shape[1], grammar_bitmask.shape[1] * 32)
    rows = torch.from_numpy(np.ascontiguousarray(grammar_bitmask[bitmask_rows]))  # [n, words]
    allowed = unpack_bitmask(rows.to(logits.device), vocab_size)  # bool [n, vocab_size]
    # bool [num_logits, vocab_size]: True where a grammar forbids the token
    disallowed = torch.zeros(logits.shape[0], vocab_size, dtype=torch.bool, device=logits.device)
    disallowed[torch.tensor(out_indices, device=logits.device)] = ~allowed
    logits[:, :vocab_size].masked_fill_(disallowed, float("-inf"))  # in place, [num_logits, V]


# END LAB 12.3


def choice_as_grammar(choice: list[str]) -> str:
    """An EBNF grammar whose language is exactly the strings of ``choice``."""
    escaped = (re.sub(r'(["\\])', r"\\\1", c) for c in choice)
    return "root ::= " + " | ".join(f'"{c}"' for c in escaped)
