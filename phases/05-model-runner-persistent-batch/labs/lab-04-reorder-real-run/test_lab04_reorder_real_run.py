"""Lab 05.4 — decodes first, then a real run of your whole runner.

Graded: the two ``LAB 05.4`` regions of ``labs/phase_05/utils.py``
(``reorder_batch_to_split_decodes_and_prefills``: each row's region, and
the swaps that put the rows in region order); then, as whole-phase checks,
every Phase 05 region of yours at once in mini_vllm's engine.

The reorder is checked on batches that record every ``swap_states`` call:
the rules first (regions, threshold, a batch already in order, only
misplaced rows move), then random batches against the reference and against
the pinned upstream's function (same answer, same swaps in the same order).
Then your ``InputBatch``, ``BlockTable``, ``_update_states`` and reorder
run inside the engine (the torch attention backend asks for the decode-first
order): a tiny seeded Llama under chunked prefill and forced preemption, and
SmolLM2-135M once, must produce HuggingFace transformers' greedy tokens.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mini_vllm.attention.backends.utils import (
    reorder_batch_to_split_decodes_and_prefills as reference_reorder,
)
from mini_vllm.engine.llm_engine import LLMEngine
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.grading.checks import engine_greedy_tokens, lab_settings
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.testing import hf_greedy

from phase05_helpers import (
    RecordingBatch,
    assert_plugged,
    every_region_written,
    plug_into_engine,
    written,
)

PROPERTY = lab_settings(100, shrink=True)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REGION_NAMES = ["decode", "short extend", "long extend", "prefill"]


def region_of(prompt, computed, scheduled, threshold) -> int:
    """The rule, row by row (the region the row must end up in)."""
    if computed == 0:
        return 3
    if scheduled > threshold:
        return 2
    return 0 if computed >= prompt else 1


def reorder(fn, rows, scheduled, threshold=1):
    """(returned, swaps, final order) of ``fn`` on a recording batch; rows
    are (num_prompt_tokens, num_computed_tokens), scheduled the step's
    tokens per row."""
    batch = RecordingBatch(rows)
    so = SimpleNamespace(num_scheduled_tokens={f"r{i}": n for i, n in enumerate(scheduled)})
    moved = written(fn, batch, so, decode_threshold=threshold)
    return moved, batch.swaps, batch.req_ids


def describe(rows, scheduled, threshold) -> str:
    return ", ".join(
        f"r{i} (prompt {p}, computed {c}, scheduled {s}: "
        f"{REGION_NAMES[region_of(p, c, s, threshold)]})"
        for i, ((p, c), s) in enumerate(zip(rows, scheduled, strict=True))
    )


def check_against(fn, want_fn, rows, scheduled, threshold, who):
    got = reorder(fn, rows, scheduled, threshold)
    want = reorder(want_fn, rows, scheduled, threshold)
    assert got == want, (
        f"On rows {describe(rows, scheduled, threshold)} (decode_threshold {threshold}), "
        f"{who} returns {want[0]} after swaps {want[1]}, order {want[2]}; yours returns "
        f"{got[0]} after swaps {got[1]}, order {got[2]}. Only misplaced rows move: the "
        "misplaced rows, taken in region order, fill the misplaced positions in row order, "
        "and each cycle of that permutation is followed from its first row."
    )


# ------------------------------------------------------------ the rules


@pytest.mark.points(3)
def test_rows_end_in_region_order(impl):
    rows = [(10, 3), (4, 0), (4, 4), (10, 3), (6, 6), (2, 0), (8, 8)]
    scheduled = [1, 4, 1, 5, 1, 1, 1]
    _, _, order = reorder(impl.utils.reorder_batch_to_split_decodes_and_prefills, rows, scheduled)
    regions = {
        f"r{i}": region_of(*r, s, 1) for i, (r, s) in enumerate(zip(rows, scheduled, strict=True))
    }
    got = [REGION_NAMES[regions[r]] for r in order]
    assert [regions[r] for r in order] == sorted(regions.values()), (
        "After the reorder the rows must run decode, short extend, long extend, prefill. "
        f"Rows: {describe(rows, scheduled, 1)}. A row with no context is a prefill even with "
        "one new token; with context, more than decode_threshold new tokens is a long extend; "
        f"otherwise a decode once the prompt is done, else a short extend. Your order {order} "
        f"gives regions {got}."
    )


@pytest.mark.points(2)
def test_decode_threshold_widens_the_decodes(impl):
    fn = impl.utils.reorder_batch_to_split_decodes_and_prefills
    rows, scheduled = [(3, 0), (5, 5), (5, 5)], [3, 2, 3]
    check_against(fn, reference_reorder, rows, scheduled, 2, "the reference")
    moved, _, order = reorder(fn, rows, scheduled, threshold=2)
    assert order[0] == "r1" and moved, (
        "With decode_threshold 2, r1 (prompt done, 2 new tokens) is a decode and goes first; "
        f"r2 (3 new tokens) is a long extend. Your order: {order}."
    )


@pytest.mark.points(2)
def test_a_batch_in_order_is_left_alone(impl):
    fn = impl.utils.reorder_batch_to_split_decodes_and_prefills
    rows, scheduled = [(4, 4), (4, 4), (9, 2), (9, 3), (5, 0)], [1, 1, 1, 4, 5]
    got = reorder(fn, rows, scheduled)
    assert got == (False, [], ["r0", "r1", "r2", "r3", "r4"]), (
        f"Rows {describe(rows, scheduled, 1)} are already in region order: the function must "
        f"return False and make no swap. Got (returned, swaps, order) {got}."
    )
    assert reorder(fn, [], []) == (False, [], []), "An empty batch: False, no swap."


@pytest.mark.points(3)
def test_only_misplaced_rows_move_each_cycle_followed(impl):
    fn = impl.utils.reorder_batch_to_split_decodes_and_prefills
    # r0 prefill, r1 decode, r2 decode, r3 decode: the misplaced rows are 0 and
    # 3 (r1 and r2 are already in the decode positions): one swap.
    check_against(
        fn, reference_reorder, [(5, 0), (4, 4), (4, 4), (4, 4)], [5, 1, 1, 1], 1, "the reference"
    )
    # Prefill, long extend, decode: rows 0 and 2 trade places (one swap).
    # Prefill, decode, long extend: every row is misplaced, a 3-cycle (two swaps).
    check_against(fn, reference_reorder, [(5, 0), (9, 2), (4, 4)], [5, 4, 1], 1, "the reference")
    check_against(fn, reference_reorder, [(5, 0), (4, 4), (9, 2)], [5, 1, 4], 1, "the reference")


@st.composite
def batches(draw):
    rows, scheduled = [], []
    for _ in range(draw(st.integers(0, 12))):
        prompt = draw(st.integers(1, 40))
        computed = draw(st.sampled_from([0, prompt]) | st.integers(0, prompt + 10))
        rows.append((prompt, computed))
        scheduled.append(draw(st.sampled_from([1, 1, 2]) | st.integers(1, 30)))
    return rows, scheduled


@pytest.mark.points(4)
@PROPERTY
@given(batch=batches(), threshold=st.sampled_from([1, 1, 2, 4]))
def test_random_batches_match_the_reference(impl, batch, threshold):
    fn = impl.utils.reorder_batch_to_split_decodes_and_prefills
    check_against(fn, reference_reorder, *batch, threshold, "the reference")


@pytest.mark.upstream
@pytest.mark.points(5)
@pytest.mark.timeout(60)
@PROPERTY
@given(batch=batches(), threshold=st.sampled_from([1, 1, 2, 4]))
def test_random_batches_match_upstream(impl, batch, threshold):
    from vllm.v1.attention.backends.utils import (
        reorder_batch_to_split_decodes_and_prefills as upstream_reorder,
    )

    fn = impl.utils.reorder_batch_to_split_decodes_and_prefills
    check_against(fn, upstream_reorder, *batch, threshold, "upstream")


# ------------------------------------------------------------ the real runs


def first_difference(got, want) -> int:
    return next(
        (k for k, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
        min(len(got), len(want)),
    )


def run_and_compare(impl, llm, hf, prompts, lengths):
    assert_plugged(impl, llm)
    outs = written(
        llm.generate,
        [{"prompt_token_ids": p} for p in prompts],
        [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths],
        use_tqdm=False,
    )
    for i, (prompt, out, n) in enumerate(zip(prompts, outs, lengths, strict=True)):
        got, want = out.outputs[0].token_ids, hf_greedy(hf, prompt, n)
        k = first_difference(got, want)
        assert got == want, (
            f"Prompt {i} ({len(prompt)} tokens): greedy token {k} through the engine with your "
            f"batch, block table, _update_states and reorder is {got[k : k + 1]}, HuggingFace "
            f"transformers' is {want[k : k + 1]} (all: yours {got}, transformers {want}). The "
            "model read the wrong tokens, positions or KV slots: the lab checks above "
            "(make check-lab-05.1 ... 05.4) name the broken rule."
        )
    return llm.llm_engine.get_stats()


@pytest.mark.phase
@pytest.mark.points(5)
@pytest.mark.timeout(120)
def test_tiny_llama_through_your_runner_equals_transformers(impl, tiny_llama, monkeypatch):
    # Eight requests of different lengths, at most four at a time: as one
    # finishes, the next joins in its (low) row and prefills there, before
    # rows that decode, so the reorder swaps rows. Block size 4, a token
    # budget of 8 (prompts prefilled in chunks beside decodes) and a KV cache
    # of 12 usable blocks, too small for four requests: some are preempted
    # and resumed.
    path, hf = tiny_llama
    every_region_written(impl)
    plug_into_engine(impl, monkeypatch)
    llm = LLM(
        path,
        max_model_len=48,
        num_gpu_blocks_override=13,
        block_size=4,
        max_num_batched_tokens=8,
        max_num_seqs=4,
        attention_backend="torch",
        device=DEVICE,
        dtype="float32",
    )
    prompts = [[(7 * i + 13 * j) % 509 + 3 for j in range(2 + 5 * i % 17)] for i in range(8)]
    stats = run_and_compare(impl, llm, hf, prompts, [2 + 5 * i % 11 for i in range(8)])
    assert stats["num_preemptions"] > 0, f"the setup must force preemptions: {stats}"


SMOL_TEXTS = [
    "The capital of France is",
    "A persistent batch keeps one row per request, so a decode step",
]
SMOL_TOKENS = 4


def engine_tokens(engine) -> list[list[int]]:
    """Greedy tokens of SMOL_TEXTS through ``engine``, in prompt order."""
    return engine_greedy_tokens(engine, SMOL_TEXTS, SMOL_TOKENS)


@pytest.fixture(scope="module")
def smollm2_reference():
    """SmolLM2 loaded once, and the reference engine's greedy tokens on it.

    A 16-token step budget: the longer prompt is prefilled in two chunks, the
    second beside the other's decode, so the batch is reordered. (The
    reference engine's SmolLM2 tokens equal transformers': see
    tests/test_engine.py. Loading SmolLM2 a second time, into transformers,
    would double this lab's run time.)"""
    from mini_vllm.model_executor.model_loader import smollm2_gguf_path

    llm = LLM(
        str(smollm2_gguf_path()),
        max_model_len=96,
        block_size=16,
        num_gpu_blocks_override=16,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        attention_backend="torch",
        device=DEVICE,
        dtype="float32",
    )
    reference = llm.llm_engine
    return reference, engine_tokens(reference), reference.get_stats()


@pytest.mark.phase
@pytest.mark.points(5)
@pytest.mark.timeout(600)
def test_smollm2_through_your_runner_equals_the_reference(impl, request, monkeypatch):
    every_region_written(impl)  # before SmolLM2 is loaded
    reference, want, ref_stats = request.getfixturevalue("smollm2_reference")
    # Without chunking: one step for all prompts, then SMOL_TOKENS - 1 decode steps.
    assert ref_stats["num_steps"] > SMOL_TOKENS, f"the setup must chunk the prompts: {ref_stats}"
    plug_into_engine(impl, monkeypatch)
    config = dataclasses.replace(
        reference.vllm_config,
        cache_config=dataclasses.replace(reference.vllm_config.cache_config),
    )
    engine = LLMEngine(config, (reference.model, reference.hf_config, reference.tokenizer))
    assert_plugged(impl, SimpleNamespace(llm_engine=engine))
    got = engine_tokens(engine)
    tokenizer = reference.tokenizer
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        k = first_difference(g, w)
        assert g == w, (
            f"SmolLM2, prompt {i} ({SMOL_TEXTS[i]!r}): greedy token {k} with your batch, block "
            f"table, _update_states and reorder is {g[k : k + 1]} "
            f"{tokenizer.decode(g[: k + 1])!r}, the reference engine's {w[k : k + 1]} "
            f"{tokenizer.decode(w[: k + 1])!r}. Greedy decoding is deterministic: the model "
            "read the wrong tokens, positions or KV slots. The lab checks above (make "
            "check-lab-05.1 ... 05.4) name the broken rule."
        )
