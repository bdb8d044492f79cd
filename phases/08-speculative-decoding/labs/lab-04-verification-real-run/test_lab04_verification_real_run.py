"""Lab 08.4 — verification in the runner, and a real run.

Graded: the two ``LAB 08.4`` regions of ``labs/phase_08/gpu_model_runner.py``:
``_write_spec_token_ids`` (a row's scheduled drafts go right after its real
tokens, so they are the inputs of the verifying forward pass) and
``_calc_spec_decode_metadata`` (which logits rows verify which drafts:
the last ``d + 1`` positions of a row with ``d`` drafts, split into ``d``
target rows and one bonus row, and the drafts read back from the inputs).

First the drafts' place in the batch, on a real ``InputBatch``; then, marked
``upstream``, your metadata against the pinned upstream's
``GPUModelRunner._calc_spec_decode_metadata`` (vllm/v1/worker/gpu_model_runner.py:2713),
called on a CPU on a stand-in runner holding only what it reads
(mini_vllm/oracle/spec_workload.py), for generated drafts and batches;
then, marked ``phase`` (every Phase 08 region is yours), SmolLM2 through an
engine built from your scheduler, proposer, rejection sampler and runner,
greedy with n-gram speculation (3 drafts, prompt lookup 1 to 3): the tokens
must be the reference engine's without speculation, token for token, with
drafts both accepted and rejected on the way.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from phase08_helpers import NGRAM, PROMPTS, greedy_tokens, plug_into_engine, smollm2_engine, written

from mini_vllm.grading.checks import lab_settings
from mini_vllm.oracle.spec_workload import mini_sampling_metadata, upstream_spec_decode_metadata
from mini_vllm.outputs import DraftTokenIds, ModelRunnerOutput
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.spec_decode.metadata import SpecDecodeMetadata
from mini_vllm.testing import create_requests, create_scheduler
from mini_vllm.worker.gpu_input_batch import CachedRequestState, InputBatch

LOCKSTEP = lab_settings(60)
CPU = torch.device("cpu")

pytestmark = pytest.mark.timeout(60)


def stand_in_runner(impl, **attributes):
    """Your GPUModelRunner without a model: only the attributes given."""
    runner = object.__new__(impl.gpu_model_runner.GPUModelRunner)
    runner.__dict__.update(attributes)
    return runner


def your_metadata(impl, num_draft_tokens, cu_num_scheduled_tokens, input_ids):
    size = int(cu_num_scheduled_tokens[-1]) + 1
    runner = stand_in_runner(
        impl,
        arange_np=np.arange(size, dtype=np.int64),
        input_ids=SimpleNamespace(gpu=input_ids, cpu=input_ids, np=input_ids.numpy()),
        device=CPU,
    )
    return written(runner._calc_spec_decode_metadata, num_draft_tokens, cu_num_scheduled_tokens)


FIELDS = (
    "logits_indices",
    "target_logits_indices",
    "bonus_logits_indices",
    "cu_num_draft_tokens",
    "cu_num_sampled_tokens",
    "draft_token_ids",
    "num_draft_tokens",
)


def as_list(value):
    return value.tolist() if hasattr(value, "tolist") else list(value)


# ------------------------------------------------------------------ the rules


@pytest.mark.points(5)
def test_drafts_go_right_after_the_real_tokens(impl):
    batch = InputBatch(4, 32, 64, CPU, False, 100, [16])
    for req_id, prompt, output in (("a", [1, 2, 3], [4]), ("b", [5, 6], []), ("c", [7], [8, 9])):
        params = SamplingParams(temperature=0.0, max_tokens=8)
        batch.add_request(
            CachedRequestState(req_id, prompt, params, None, ([1],), len(prompt), list(output))
        )
    before = batch.token_ids_cpu.copy()
    counts = batch.num_tokens_no_spec.copy()
    runner = stand_in_runner(impl, input_batch=batch)
    out = SimpleNamespace(scheduled_spec_decode_tokens={"c": [30, 31, 32], "a": [10, 11]})
    written(runner._write_spec_token_ids, out)
    rows = {r: batch.token_ids_cpu[batch.req_id_to_index[r], :7].tolist() for r in "abc"}
    want = {"a": [1, 2, 3, 4, 10, 11, 0], "b": [5, 6, 0, 0, 0, 0, 0], "c": [7, 8, 9, 30, 31, 32, 0]}
    assert rows == want, (
        f"token_ids_cpu rows after writing drafts {out.scheduled_spec_decode_tokens}: got "
        f"{rows}, want {want}. Each request's drafts go right after its real tokens (from "
        "num_tokens_no_spec of its row, req_id_to_index[req_id]); a row without drafts is "
        "untouched."
    )
    assert (batch.num_tokens_no_spec == counts).all(), (
        f"num_tokens_no_spec must not count the drafts (they are guesses until verified): "
        f"was {counts.tolist()[:3]}, now {batch.num_tokens_no_spec.tolist()[:3]}."
    )
    assert (batch.token_ids_cpu[3:] == before[3:]).all(), "rows past the batch were written"


@pytest.mark.points(5)
def test_the_metadata_of_a_worked_example(impl):
    # Rows with 3, 0 and 2 drafts; 4, 100 and 3 tokens scheduled (the middle row prefills).
    input_ids = torch.arange(1000, 1107, dtype=torch.int32)  # the input at position i is 1000 + i
    meta = your_metadata(
        impl, np.array([3, 0, 2], dtype=np.int32), np.array([4, 104, 107], np.int32), input_ids
    )
    got = {f: as_list(getattr(meta, f)) for f in FIELDS}
    want = {
        "logits_indices": [0, 1, 2, 3, 103, 104, 105, 106],
        "target_logits_indices": [0, 1, 2, 5, 6],
        "bonus_logits_indices": [3, 4, 7],
        "cu_num_draft_tokens": [3, 3, 5],
        "cu_num_sampled_tokens": [4, 5, 8],
        "draft_token_ids": [1001, 1002, 1003, 1105, 1106],
        "num_draft_tokens": [3, 0, 2],
    }
    wrong = {f: (got[f], want[f]) for f in FIELDS if got[f] != want[f]}
    assert not wrong, (
        "drafts [3, 0, 2], cumulative scheduled tokens [4, 104, 107]: "
        + "; ".join(f"{f}: got {g}, want {w}" for f, (g, w) in wrong.items())
        + ". A row with d drafts keeps its LAST d + 1 positions; of the kept rows, its first "
        "d verify the drafts (target) and the last samples the bonus; a draft is the input "
        "right after its target position."
    )


# ------------------------------------------------------------------ against upstream


@st.composite
def batches(draw):
    """(num_draft_tokens, num_scheduled_tokens): rows with drafts schedule
    1 + drafts tokens (a decode); rows without, 1 to 9 (decodes and prefills)."""
    n = draw(st.integers(1, 6))
    drafts = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    if not any(drafts):
        drafts[draw(st.integers(0, n - 1))] = draw(st.integers(1, 5))
    scheduled = [d + 1 if d else draw(st.integers(1, 9)) for d in drafts]
    return drafts, scheduled


@pytest.mark.upstream
@pytest.mark.points(8)
@pytest.mark.timeout(180)
@example(([3, 0, 2, 0, 1], [4, 100, 3, 100, 2]))  # upstream's own comment's example
@LOCKSTEP
@given(case=batches())
def test_metadata_equals_upstreams(impl, case):
    drafts, scheduled = case
    num_draft_tokens = np.array(drafts, dtype=np.int32)
    cu = np.cumsum(scheduled, dtype=np.int32)
    g = torch.Generator().manual_seed(int(cu[-1]))
    input_ids = torch.randint(0, 1000, (int(cu[-1]),), generator=g, dtype=torch.int32)
    expected = upstream_spec_decode_metadata(num_draft_tokens.copy(), cu.copy(), input_ids)
    got = your_metadata(impl, num_draft_tokens.copy(), cu.copy(), input_ids)
    for f in FIELDS:
        e, y = as_list(getattr(expected, f)), as_list(getattr(got, f))
        assert e == y, (
            f"drafts per row {drafts}, scheduled tokens per row {scheduled} (cumulative "
            f"{cu.tolist()}): {f} differs.\n  upstream {e}\n  yours    {y}"
        )
    assert got.max_spec_len == max(drafts), f"max_spec_len {got.max_spec_len}"


# ------------------------------------------------------------------ SmolLM2


def every_region_written(impl) -> None:
    """Fail at once if a Phase 08 region still raises NotImplementedError,
    before SmolLM2 runs: a few cheap calls that reach every region."""
    sched = create_scheduler(scheduler_cls=impl.scheduler.Scheduler, num_speculative_tokens=2)
    (req,) = create_requests(1, prompt_token_ids=[[1, 2, 3]], max_tokens=8)
    sched.add_request(req)
    for sampled in ([5], [7, 6]):  # the second step verifies the draft [7]
        out = written(sched.schedule)
        runner_output = ModelRunnerOutput(
            req_ids=[req.request_id],
            req_id_to_index={req.request_id: 0},
            sampled_token_ids=[sampled],
        )
        written(sched.update_from_output, out, runner_output)
        written(sched.update_draft_token_ids, DraftTokenIds([req.request_id], [[7]]))
    proposer = impl.ngram_proposer.NgramProposer(1, 2, 2, 8)
    written(proposer.propose, [[1]], np.array([3]), np.array([[1, 2, 1, 0, 0, 0, 0, 0]]))
    meta = SpecDecodeMetadata.make_dummy([[1]])
    for temperature in (0.0, 1.0):
        written(
            impl.rejection_sampler.rejection_sample,
            meta.draft_token_ids,
            meta.num_draft_tokens,
            meta.max_spec_len,
            meta.cu_num_draft_tokens,
            None,
            torch.zeros(1, 4),  # [1, vocab]
            torch.zeros(1, 1, dtype=torch.int32),  # [1, 1]
            mini_sampling_metadata([temperature], [None]),
        )
    your_metadata(impl, np.array([1], np.int32), np.array([2], np.int32), torch.zeros(2).int())
    runner = stand_in_runner(impl, input_batch=InputBatch(1, 8, 8, CPU, False, 10, [16]))
    written(runner._write_spec_token_ids, SimpleNamespace(scheduled_spec_decode_tokens={}))


@pytest.mark.phase
@pytest.mark.points(8)
@pytest.mark.timeout(600)
def test_smollm2_greedy_with_your_speculation_equals_without(impl, request, monkeypatch):
    every_region_written(impl)  # before SmolLM2 is loaded
    reference, want = request.getfixturevalue("smollm2_reference")
    plug_into_engine(impl, monkeypatch)
    engine = smollm2_engine(NGRAM, reference=reference)
    core = engine.engine_core
    assert type(core.scheduler) is impl.scheduler.Scheduler, "the engine must run your Scheduler"
    assert type(core.model_runner) is impl.gpu_model_runner.GPUModelRunner
    assert type(core.model_runner.drafter) is impl.ngram_proposer.NgramProposer
    got = greedy_tokens(engine)
    tokenizer = reference.tokenizer
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        k = next((j for j, (x, y) in enumerate(zip(g, w, strict=False)) if x != y), len(w))
        assert g == w, (
            f"SmolLM2, prompt {i} ({PROMPTS[i]!r}), greedy with n-gram speculation {NGRAM}: "
            f"token {k} is {g[k : k + 1]} {tokenizer.decode(g[: k + 1])!r}, without speculation "
            f"{w[k : k + 1]} {tokenizer.decode(w[: k + 1])!r}. Greedy verification keeps exactly "
            "the target's argmax tokens, so speculation must not change a single one: a draft "
            "verified against the wrong logits row, a draft not in the inputs, or a rejected "
            "draft's KV position not rolled back. The lab checks above (make check-lab-08.1 ... "
            "08.4) name the broken rule."
        )
    stats = engine.get_stats()
    accepted, drafted = stats["spec_num_accepted_tokens"], stats["spec_num_draft_tokens"]
    assert accepted > 0, (
        f"no draft was accepted on prompts built to repeat themselves ({stats}): the drafts "
        "never reached the model, or were verified against the wrong rows."
    )
    assert drafted > accepted, f"no draft was rejected, so the rollback never ran: {stats}"
