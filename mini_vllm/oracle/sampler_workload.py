"""Sampler workloads: one persistent batch of mixed sampling requests, built twice.

Builds the same generated requests into mini_vllm's ``InputBatch`` and into
the pinned upstream's, the way the runner does (``SamplingParams`` ->
``update_from_generation_config`` -> ``InputBatch.add_request``, then
removals and ``condense`` so rows move, then ``refresh_metadata``), so that
``Sampler(logits, batch.sampling_metadata)`` can run on both
(DESIGN.md, Phase 06). Also generates sequences of ``BatchUpdate``s shaped
like the persistent batch's (removals, additions into the lowest holes,
condense moves, swaps) for the logits processors. Used by
tests/upstream/test_sampler_lockstep.py and the Phase 06 graders
(phases/06-sampling-logits-processors/labs/).

Upstream on a CPU needs one patch: its penalties module asks
``is_pin_memory_available``, which must say False without CUDA
(``upstream_sampling`` sets it so, for the process, where there is no
CUDA). Upstream's batch gets its built-in processors (min_tokens,
logit_bias, min_p); mini's gets the runner's
``build_logitsprocs`` (min_tokens is state of mini's batch).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from hypothesis import strategies as st

from mini_vllm.config import LOGPROBS_MODES
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.worker.gpu_input_batch import CachedRequestState, InputBatch

EOS = 1
MAX_REQS = 8
CONFIG = SimpleNamespace(
    scheduler_config=SimpleNamespace(max_num_seqs=MAX_REQS),
    model_config=SimpleNamespace(logits_processors=None),
)
CPU = torch.device("cpu")
BUILTIN_NAMES = ("MinTokensLogitsProcessor", "LogitBiasLogitsProcessor", "MinPLogitsProcessor")


def upstream_sampling() -> SimpleNamespace:
    """The pinned upstream's sampling modules, its penalties told there is no pinned memory."""
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    import vllm.v1.sample.ops.penalties as penalties
    from vllm.sampling_params import SamplingParams as UpSamplingParams
    from vllm.v1.sample import logits_processor
    from vllm.v1.sample.ops import topk_topp_sampler
    from vllm.v1.sample.sampler import Sampler as UpSampler
    from vllm.v1.worker import gpu_input_batch

    if not torch.cuda.is_available():  # pinning needs CUDA; upstream asks anyway
        penalties.is_pin_memory_available = lambda: False
    return SimpleNamespace(
        SamplingParams=UpSamplingParams,
        Sampler=UpSampler,
        lp=logits_processor,
        batch=gpu_input_batch,
        penalties=penalties,
        topk_topp=topk_topp_sampler,
    )


# ------------------------------------------------------------ mixed batches


@st.composite
def requests(draw, vocab: int):
    """(SamplingParams keyword arguments, bad words as token ids, prompt, output)."""
    ids = st.integers(0, vocab - 1)
    params = {
        "temperature": draw(st.sampled_from([0.0, 0.0, 0.005, 0.5, 1.0, 1.7])),
        "top_k": draw(st.sampled_from([0, 0, 1, 2, vocab // 2, vocab - 1, vocab])),
        "top_p": draw(st.sampled_from([1.0, 1.0, 0.2, 0.5, 0.9])),
        "min_p": draw(st.sampled_from([0.0, 0.05, 0.3, 0.6])),
        "presence_penalty": draw(st.sampled_from([0.0, 0.0, -1.0, 0.5, 2.0])),
        "frequency_penalty": draw(st.sampled_from([0.0, 0.0, -0.5, 1.0])),
        "repetition_penalty": draw(st.sampled_from([1.0, 0.7, 1.3, 2.0])),
        "logit_bias": draw(
            st.none() | st.dictionaries(ids, st.sampled_from([-100.0, -2.5, 3.0, 100.0]))
        )
        or None,
        "allowed_token_ids": draw(st.none() | st.lists(ids, min_size=1, max_size=vocab)),
        "min_tokens": draw(st.sampled_from([0, 0, 2, 5])),
        "max_tokens": 16,
        "seed": draw(st.none() | st.integers(0, 2**31)),
        "logprobs": draw(st.sampled_from([None, None, 0, 1, 3])),
        "ignore_eos": draw(st.booleans()),
        "stop_token_ids": draw(st.lists(ids, max_size=2)),
    }
    bad_words = draw(st.lists(st.lists(ids, min_size=1, max_size=3), max_size=3))
    prompt = draw(st.lists(ids, min_size=1, max_size=6))
    output = draw(st.lists(ids, max_size=6))
    return params, bad_words, prompt, output


@dataclass
class SamplerCase:
    vocab: int
    rows: list  # one requests() draw per request, r0, r1, ...
    removed: list[int]  # requests removed before condense
    logits: torch.Tensor  # float32 [MAX_REQS, vocab]; the batch reads its first rows
    logprobs_mode: str = "raw_logprobs"
    params: dict = field(default_factory=dict)


@st.composite
def sampler_cases(draw, logprobs_modes=LOGPROBS_MODES):
    vocab = draw(st.integers(6, 20))
    rows = draw(st.lists(requests(vocab), min_size=2, max_size=MAX_REQS))
    removed = draw(st.sets(st.integers(0, len(rows) - 1), max_size=len(rows) - 1))
    values = st.one_of(st.sampled_from([-2.0, 0.0, 1.0, 1.0, 3.0]), st.floats(-6, 6, width=32))
    logits = draw(st.lists(values, min_size=vocab * MAX_REQS, max_size=vocab * MAX_REQS))
    mode = draw(st.sampled_from(logprobs_modes))
    return SamplerCase(
        vocab, rows, sorted(removed), torch.tensor(logits).view(MAX_REQS, vocab), mode
    )


def generator_of(params: dict) -> torch.Generator | None:
    """The runner's generator: only a random request with a seed gets one."""
    if params.get("seed") is None or params.get("temperature", 1.0) < 1e-5:
        return None
    return torch.Generator().manual_seed(params["seed"])


def mini_batch(case: SamplerCase, input_batch_cls=InputBatch, logitsprocs=None) -> InputBatch:
    """mini's persistent batch holding ``case``'s requests, condensed and refreshed."""
    if logitsprocs is None:
        from mini_vllm.worker.gpu_model_runner import build_logitsprocs

        logitsprocs = build_logitsprocs(CONFIG, CPU)
    batch = input_batch_cls(MAX_REQS, 64, 64, CPU, False, case.vocab, [16], logitsprocs)
    for i, (params, bad_words, prompt, output) in enumerate(case.rows):
        sp = SamplingParams(**params)
        sp.update_from_generation_config({}, EOS)
        sp._bad_words_token_ids = [list(w) for w in bad_words] or None
        request = CachedRequestState(
            f"r{i}", list(prompt), sp, generator_of(params), ([],), len(prompt), list(output)
        )
        batch.add_request(request)
    for i in case.removed:
        batch.remove_request(f"r{i}")
    batch.condense()
    batch.refresh_metadata()
    return batch


def upstream_batch(up: SimpleNamespace, case: SamplerCase):
    """The pinned upstream's ``InputBatch`` holding the same requests, with its built-ins."""
    procs = [getattr(up.lp, name)(CONFIG, CPU, False) for name in BUILTIN_NAMES]
    batch = up.batch.InputBatch(
        max_num_reqs=MAX_REQS,
        max_model_len=64,
        max_num_batched_tokens=64,
        device=CPU,
        pin_memory=False,
        vocab_size=case.vocab,
        block_sizes=[16],
        kernel_block_sizes=[16],
        logitsprocs=up.lp.LogitsProcessors(procs),
    )
    for i, (params, bad_words, prompt, output) in enumerate(case.rows):
        sp = up.SamplingParams(**params)
        sp.update_from_generation_config({}, EOS)
        if bad_words:
            sp._bad_words_token_ids = [list(w) for w in bad_words]
        request = up.batch.CachedRequestState(
            req_id=f"r{i}",
            prompt_token_ids=list(prompt),
            mm_features=[],
            sampling_params=sp,
            generator=generator_of(params),
            block_ids=([],),
            num_computed_tokens=len(prompt),
            output_token_ids=list(output),
        )
        batch.add_request(request)
    for i in case.removed:
        batch.remove_request(f"r{i}")
    batch.condense()
    batch.refresh_metadata()
    return batch


def describe(case: SamplerCase, req_ids) -> str:
    """The case's rows as the batch holds them, for a failure message."""
    rows = [case.rows[int(r[1:])] for r in req_ids]
    return (
        f"logprobs_mode {case.logprobs_mode}, vocab {case.vocab}, "
        f"rows (params, bad words, prompt, output) {rows}"
    )


def first_row_difference(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """'row i: yours [...] upstream [...]' for the first row that differs bit for bit."""
    for row in range(want.shape[0]):
        if not torch.equal(got[row], want[row]):
            return f"row {row}:\n yours    {got[row].tolist()}\n upstream {want[row].tolist()}"
    return None


# ------------------------------------------------------------ batch updates


@dataclass
class UpdateStep:
    """One step of edits to a persistent batch, as its BatchUpdate will list them."""

    batch_size: int
    removed: list[int]
    added: list[tuple[int, dict, list[int], int]]  # (row, params, prompt, request number)
    moved: list[tuple[int, int, str]]  # (a, b, "swap" | "move")
    sampled: list[tuple[int, int]]  # (request number, token) appended to its output after the step


@st.composite
def update_steps(draw, vocab: int = 12, max_reqs: int = 6, max_steps: int = 8):
    """Steps shaped like the persistent batch's: removals leave holes, additions
    fill the lowest hole first, condense moves the highest rows down
    (UNIDIRECTIONAL), then a few swaps; then some rows sample a token. As in
    the batch, a hole refilled by an addition or a move is not listed as
    removed: the addition or the move replaces what the row held."""
    ids = st.integers(0, vocab - 1)
    params = st.fixed_dictionaries(
        {
            "min_p": st.sampled_from([0.0, 0.0, 0.1, 0.5]),
            "logit_bias": st.none() | st.dictionaries(ids, st.sampled_from([-5.0, 1.5, 4.0])),
            "min_tokens": st.sampled_from([0, 0, 1, 3]),
            "stop_token_ids": st.lists(ids, max_size=2),
            "ignore_eos": st.booleans(),
            "temperature": st.just(1.0),
            "max_tokens": st.just(16),
        }
    )
    rows: list[int | None] = []  # row -> request number
    number = 0
    steps = []
    for _ in range(draw(st.integers(1, max_steps))):
        live = [i for i, r in enumerate(rows) if r is not None]
        removed = sorted(draw(st.sets(st.sampled_from(live), max_size=len(live))) if live else [])
        for i in removed:
            rows[i] = None
        holes = sorted(removed)
        added = []
        room = max_reqs - (len(live) - len(removed))
        for _ in range(draw(st.integers(0, room))):
            row = holes.pop(0) if holes else len(rows)
            if row == len(rows):
                rows.append(None)
            rows[row] = number
            prompt = draw(st.lists(ids, min_size=1, max_size=4))
            added.append((row, draw(params), prompt, number))
            number += 1
        moved = []
        holes = sorted(holes)
        last = len(rows) - 1
        while holes:
            while last >= 0 and rows[last] is None:
                last -= 1
            if holes[0] >= last:
                break
            hole = holes.pop(0)
            rows[hole], rows[last] = rows[last], None
            moved.append((last, hole, "move"))
            last -= 1
        del rows[sum(r is not None for r in rows) :]
        # What the processors hear as removed: the holes neither an addition nor
        # condense filled (both take theirs off the builder's removed list).
        removed = sorted(holes, reverse=True)
        size = len(rows)
        for _ in range(draw(st.integers(0, 2)) if size >= 2 else 0):
            a, b = draw(st.integers(0, size - 1)), draw(st.integers(0, size - 1))
            if a != b:
                rows[a], rows[b] = rows[b], rows[a]
                moved.append((a, b, "swap"))
        sampled = [(rows[row], draw(ids)) for row in range(size) if draw(st.booleans())]
        steps.append(UpdateStep(size, removed, added, moved, sampled))
    return steps


def batch_update_of(
    step: UpdateStep, params_cls, batch_update_cls, directions, outputs: dict[int, list[int]]
):
    """``step`` as a BatchUpdate of one side (its SamplingParams, BatchUpdate and
    MoveDirectionality classes); ``outputs`` maps request number -> that side's
    live output list, created here for new requests."""
    added = []
    for row, params, prompt, number in step.added:
        sp = params_cls(**params)
        sp.update_from_generation_config({}, EOS)
        outputs[number] = []
        added.append((row, sp, list(prompt), outputs[number]))
    moved = [
        (a, b, directions.SWAP if kind == "swap" else directions.UNIDIRECTIONAL)
        for a, b, kind in step.moved
    ]
    return batch_update_cls(
        batch_size=step.batch_size, removed=list(step.removed), added=added, moved=moved
    )
