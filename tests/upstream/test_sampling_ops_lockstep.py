"""Sampling building blocks against the pinned upstream's own functions, on CPU.

Hypothesis generates small logits batches (with ties, zeros and -inf) and the
inputs each piece reads; mini_vllm's function and upstream's get equal
copies and must return bit-identical tensors:
- penalties: ``apply_all_penalties`` (prompt tensor padded with vocab_size,
  output lists with -1 placeholders);
- top-k / top-p masks: ``apply_top_k_top_p`` as it runs here and the CPU
  platform's top-k-only path; then ``TopKTopPSampler.forward_native``:
  same tokens from the same global seed and per-row generators, same
  processed logprobs;
- bad words; the allowed-token-ids mask as upstream's ``InputBatch`` builds
  it, applied by upstream's ``Sampler.apply_logits_processors``;
- the built-in processors (min_p, logit_bias, min_tokens) driven through the
  same random sequence of persistent-batch steps (removals, additions,
  condense moves, swaps, new output tokens) by mini's and upstream's
  ``BatchUpdateBuilder``: after every step the BatchUpdates, the processors'
  per-row state and the processed logits must agree. A failure names the
  first step and row that differ.

The CPU patch DESIGN.md names for these pieces (the penalties module's
``is_pin_memory_available`` returns False) is applied inside the ``up``
fixture and undone after the module; the other one (CustomOps built inside
``set_current_vllm_config``) is not needed, since none of these pieces is a
CustomOp. MINI_VLLM_SAMPLING_EXAMPLES sets the
number of generated cases per test (default 40).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mini_vllm.sample import logits_processor as mini_lp
from mini_vllm.sample.ops import allowed_token_ids as mini_allowed
from mini_vllm.sample.ops import bad_words as mini_bad_words
from mini_vllm.sample.ops import penalties as mini_penalties
from mini_vllm.sample.ops import topk_topp_sampler as mini_topk
from mini_vllm.tiers import examples

pytestmark = pytest.mark.upstream

EXAMPLES = examples(40, 20, "MINI_VLLM_SAMPLING_EXAMPLES")
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
NEG_INF = float("-inf")
EOS = 1  # the EOS id the engine would put into every request's stop ids


@pytest.fixture(scope="module")
def up():
    """Upstream's sampling modules, with the penalties module's pinned-memory check off."""
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    import vllm.v1.sample.ops.penalties as penalties
    from vllm.sampling_params import SamplingParams
    from vllm.utils.torch_utils import make_tensor_with_pad
    from vllm.v1.sample import logits_processor, sampler
    from vllm.v1.sample.ops import bad_words, topk_topp_sampler

    patch = pytest.MonkeyPatch()
    # No CUDA here: pinning host memory would fail (DESIGN.md, "Two small patches").
    patch.setattr(penalties, "is_pin_memory_available", lambda: False)
    yield SimpleNamespace(
        penalties=penalties,
        topk=topk_topp_sampler,
        bad_words=bad_words,
        lp=logits_processor,
        sampler=sampler,
        SamplingParams=SamplingParams,
        make_tensor_with_pad=make_tensor_with_pad,
    )
    patch.undo()


# ---------------------------------------------------------------- strategies

# A few repeated values make ties at the top-k and top-p boundaries common.
_TIES = st.sampled_from([-2.0, 0.0, 1.0, 1.0, 3.0])
_VALUES = st.one_of(_TIES, st.floats(-8, 8, width=32))


@st.composite
def logits_batches(draw, with_neg_inf=False, max_rows=5, max_vocab=24):
    rows = draw(st.integers(1, max_rows))
    vocab = draw(st.integers(2, max_vocab))
    values = st.one_of(_VALUES, st.just(NEG_INF)) if with_neg_inf else _VALUES
    logits = torch.tensor(
        draw(st.lists(values, min_size=rows * vocab, max_size=rows * vocab)),
        dtype=torch.float32,
    ).view(rows, vocab)  # float32 [B, V]
    # Every row keeps at least one finite logit, as after upstream's masks.
    dead = torch.isinf(logits).all(dim=1)
    logits[dead, 0] = 0.0
    return logits


def _token_lists(draw, rows, vocab, min_len, max_len, placeholder=False):
    token = st.integers(0, vocab - 1)
    if placeholder:
        token = st.one_of(token, st.just(-1))
    return [draw(st.lists(token, min_size=min_len, max_size=max_len)) for _ in range(rows)]


def _first_row_diff(got: torch.Tensor, want: torch.Tensor) -> str | None:
    for row in range(want.shape[0]):
        if not torch.equal(got[row], want[row]):
            return f"row {row}: mini {got[row].tolist()} != upstream {want[row].tolist()}"
    return None


# ---------------------------------------------------------------- penalties


@SETTINGS
@given(data=st.data(), logits=logits_batches(with_neg_inf=True))
def test_penalties_match_upstream(up, data, logits):
    rows, vocab = logits.shape
    prompts = _token_lists(data.draw, rows, vocab, 1, 8)
    outputs = _token_lists(data.draw, rows, vocab, 0, 8, placeholder=True)
    penalty = st.floats(-2, 2, width=32)
    presence = torch.tensor([data.draw(penalty) for _ in range(rows)])  # float32 [B]
    frequency = torch.tensor([data.draw(penalty) for _ in range(rows)])  # float32 [B]
    repetition = torch.tensor(  # float32 [B]
        [data.draw(st.one_of(st.just(1.0), st.floats(0.125, 3, width=32))) for _ in range(rows)]
    )
    # The persistent batch pads the prompts with vocab_size, as upstream's does.
    prompt_ids = up.make_tensor_with_pad(prompts, pad=vocab, dtype=torch.int64)  # [B, P]
    want = up.penalties.apply_all_penalties(
        logits.clone(), prompt_ids, presence, frequency, repetition, outputs
    )
    got = mini_penalties.apply_all_penalties(
        logits.clone(), prompt_ids, presence, frequency, repetition, outputs
    )
    diff = _first_row_diff(got, want)
    assert diff is None, f"{diff}\nprompts {prompts}\noutputs {outputs}"


# ---------------------------------------------------------------- top-k / top-p


@st.composite
def top_k_top_p(draw, rows, vocab):
    k = p = None
    if draw(st.booleans()):  # vocab means "off" for the row
        k = torch.tensor([draw(st.integers(1, vocab)) for _ in range(rows)], dtype=torch.int32)
    if draw(st.booleans()):
        p_value = st.one_of(
            st.just(1.0), st.sampled_from([0.1, 0.25, 0.5, 0.75, 0.9]), st.floats(0.01, 1)
        )
        p = torch.tensor([draw(p_value) for _ in range(rows)], dtype=torch.float32)
    return k, p


@SETTINGS
@given(data=st.data(), logits=logits_batches(with_neg_inf=True))
def test_top_k_top_p_masks_match_upstream(up, data, logits):
    k, p = data.draw(top_k_top_p(*logits.shape))
    got = mini_topk.apply_top_k_top_p(logits.clone(), k, p)
    # The path upstream takes here (no CPU platform, no Triton), and the one
    # the CPU platform takes (a top-k without top-p skips the sort).
    for allow_cpu_sync in (False, True):
        want = up.topk.apply_top_k_top_p_pytorch(logits.clone(), k, p, allow_cpu_sync)
        diff = _first_row_diff(got, want)
        assert diff is None, f"{diff}\nk {k}\np {p}\nallow_cpu_sync {allow_cpu_sync}"
    assert torch.equal(up.topk.apply_top_k_top_p(logits.clone(), k, p), got)


@pytest.mark.parametrize("vocab", [2, 4, 8])
@pytest.mark.parametrize("p_value", [0.25, 0.5, 0.75])
def test_top_p_boundary_with_exact_mass_matches_upstream(up, vocab, p_value):
    """Equal logits over 2, 4 or 8 tokens give exact probabilities 1/n, so the
    cumulative mass lands exactly on 1 - p: the ``<=`` in upstream's rule decides."""
    logits = torch.zeros(1, vocab)  # float32 [1, V]
    k = torch.tensor([vocab], dtype=torch.int32)
    p = torch.tensor([p_value])
    got = mini_topk.apply_top_k_top_p(logits.clone(), k, p)
    want = up.topk.apply_top_k_top_p_pytorch(logits.clone(), k, p)
    assert torch.equal(got, want), (got, want)


@SETTINGS
@given(data=st.data(), logits=logits_batches(), mode=st.sampled_from(["raw", "processed_logprobs"]))
def test_forward_native_draws_match_upstream(up, data, logits, mode):
    rows, vocab = logits.shape
    k, p = data.draw(top_k_top_p(rows, vocab))
    seeds = {
        row: data.draw(st.integers(0, 2**31)) for row in range(rows) if data.draw(st.booleans())
    }
    global_seed = data.draw(st.integers(0, 2**31))

    def run(sampler):
        torch.manual_seed(global_seed)
        generators = {row: torch.Generator().manual_seed(s) for row, s in seeds.items()}
        tokens, processed = sampler.forward_native(logits.clone(), generators, k, p)
        # What the draw left in the global generator (untouched if every row has a seed).
        return tokens, processed, torch.random.get_rng_state()

    want_tokens, want_processed, want_rng = run(up.topk.TopKTopPSampler(mode))
    got_tokens, got_processed, got_rng = run(mini_topk.TopKTopPSampler(mode))
    assert torch.equal(got_tokens, want_tokens), (got_tokens, want_tokens, seeds, k, p)
    assert torch.equal(got_rng, want_rng), f"global generator state differs; seeds {seeds}"
    if want_processed is None:
        assert got_processed is None
    else:
        assert _first_row_diff(got_processed, want_processed) is None


# ---------------------------------------------------------------- bad words, allowed ids


@SETTINGS
@given(data=st.data(), logits=logits_batches(max_vocab=6))
def test_bad_words_match_upstream(up, data, logits):
    rows, vocab = logits.shape
    # A small vocabulary so that outputs often end with a bad word's prefix.
    outputs = _token_lists(data.draw, rows, vocab, 0, 6)
    bad_words = {
        row: _token_lists(data.draw, data.draw(st.integers(1, 3)), vocab, 1, 3)
        for row in range(rows)
        if data.draw(st.booleans())
    }
    want, got = logits.clone(), logits.clone()
    up.bad_words.apply_bad_words(want, bad_words, outputs)
    mini_bad_words.apply_bad_words(got, bad_words, outputs)
    diff = _first_row_diff(got, want)
    assert diff is None, f"{diff}\nbad words {bad_words}\noutputs {outputs}"


def _upstream_input_batch(up, max_num_reqs, vocab):
    from vllm.v1.worker.gpu_input_batch import InputBatch

    return InputBatch(
        max_num_reqs=max_num_reqs,
        max_model_len=64,
        max_num_batched_tokens=64,
        device=torch.device("cpu"),
        pin_memory=False,
        vocab_size=vocab,
        block_sizes=[16],
        kernel_block_sizes=[16],
        logitsprocs=up.lp.LogitsProcessors(),
    )


def _cached_request(req_id, prompt, params):
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    return CachedRequestState(
        req_id=req_id,
        prompt_token_ids=prompt,
        mm_features=[],
        sampling_params=params,
        generator=None,
        block_ids=([],),
        num_computed_tokens=0,
        output_token_ids=[],
    )


@SETTINGS
@given(data=st.data(), logits=logits_batches())
def test_allowed_token_ids_match_upstream(up, data, logits):
    """Upstream's InputBatch builds the mask, its Sampler applies it."""
    rows, vocab = logits.shape
    allowed = {
        row: data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=vocab))
        for row in range(rows)
        if data.draw(st.booleans())
    }
    batch = _upstream_input_batch(up, rows, vocab)
    for row in range(rows):
        params = up.SamplingParams(allowed_token_ids=allowed.get(row))
        batch.add_request(_cached_request(f"r{row}", [0], params))
    batch.refresh_metadata()
    metadata = batch.sampling_metadata
    want = up.sampler.Sampler().apply_logits_processors(logits.clone(), metadata, False)
    mask = mini_allowed.allowed_token_ids_mask(allowed, rows, vocab)
    if allowed:
        assert torch.equal(mask, metadata.allowed_token_ids_mask), allowed
    else:
        assert mask is None and metadata.allowed_token_ids_mask is None
    got = mini_allowed.apply_allowed_token_ids(logits.clone(), mask)
    diff = _first_row_diff(got, want)
    assert diff is None, f"{diff}\nallowed {allowed}"


# ---------------------------------------------------------------- logits processors

MAX_REQS = 6


@st.composite
def processor_params(draw, vocab):
    bias = st.dictionaries(st.integers(0, vocab - 1), st.floats(-5, 5, width=32), max_size=3)
    return dict(
        min_p=draw(st.one_of(st.just(0.0), st.sampled_from([0.05, 0.3, 1.0]), st.floats(0, 1))),
        logit_bias=draw(st.one_of(st.none(), bias)),
        min_tokens=draw(st.sampled_from([0, 0, 1, 2, 4])),
        stop_token_ids=draw(st.lists(st.integers(0, vocab - 1), max_size=2)),
        ignore_eos=draw(st.booleans()),
    )


@st.composite
def batch_steps(draw):
    """A vocabulary and steps of (removals, additions, swaps, tokens to append).

    Removals and swaps are fractions resolved against the live batch when
    the step runs; each addition carries its request's parameters.
    """
    vocab = draw(st.integers(4, 12))
    steps = []
    for _ in range(draw(st.integers(1, 10))):
        steps.append(
            dict(
                remove=draw(st.lists(st.floats(0, 1), max_size=4)),
                add=draw(st.lists(processor_params(vocab), max_size=3)),
                swaps=draw(st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1)), max_size=2)),
                token=draw(st.integers(0, vocab - 1)),
                logits_seed=draw(st.integers(0, 2**31)),
            )
        )
    return vocab, steps


class _Batch:
    """Which request sits in which row, edited as upstream's InputBatch does,
    with the changes recorded by mini's and upstream's builders in step."""

    def __init__(self, up):
        self.rows: list[str | None] = []
        self.outputs: dict[str, list[int]] = {}
        self.builders = (mini_lp.BatchUpdateBuilder(), up.lp.state.BatchUpdateBuilder())
        self.moves = (mini_lp.MoveDirectionality, up.lp.MoveDirectionality)

    @property
    def num_reqs(self) -> int:
        return sum(r is not None for r in self.rows)

    def remove(self, req_id: str) -> None:
        row = self.rows.index(req_id)
        self.rows[row] = None
        for builder in self.builders:
            builder.removed_append(row)

    def add(self, req_id: str, params_pair) -> None:
        rows = {b.pop_removed() for b in self.builders}
        assert len(rows) == 1, rows
        row = rows.pop()
        if row is None:
            row = len(self.rows)
            self.rows.append(None)
        self.rows[row] = req_id
        output = self.outputs.setdefault(req_id, [])  # the live list, shared by both sides
        for builder, params in zip(self.builders, params_pair, strict=True):
            builder.added.append((row, params, [0], output))

    def condense(self) -> None:
        holes = self.builders[0].removed
        assert holes == self.builders[1].removed
        last = len(self.rows) - 1
        while holes:
            while last >= 0 and self.rows[last] is None:
                last -= 1
            empty = holes[-1]
            if empty >= last:
                break
            for builder, moves in zip(self.builders, self.moves, strict=True):
                builder.pop_removed()
                builder.moved.append((last, empty, moves.UNIDIRECTIONAL))
            self.rows[empty], self.rows[last] = self.rows[last], None
        del self.rows[self.num_reqs :]

    def swap(self, i: int, j: int) -> None:
        self.rows[i], self.rows[j] = self.rows[j], self.rows[i]
        for builder, moves in zip(self.builders, self.moves, strict=True):
            builder.moved.append((i, j, moves.SWAP))


def _processor_pairs(up, vocab):
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=MAX_REQS))
    cpu = torch.device("cpu")
    names = ("MinTokensLogitsProcessor", "LogitBiasLogitsProcessor", "MinPLogitsProcessor")
    return [
        (name, getattr(mini_lp, name)(config, cpu, False), getattr(up.lp, name)(config, cpu, False))
        for name in names
    ]


def _state(name, proc):
    """A processor's per-row state in a form both sides share."""
    if name == "MinPLogitsProcessor":
        return proc.min_p_count, [proc.get_min_p_by_index(i) for i in range(MAX_REQS)]
    if name == "LogitBiasLogitsProcessor":
        return proc.biases
    return {row: (n, list(out), set(stop)) for row, (n, out, stop) in proc.min_toks.items()}


def _update_fields(update):
    if update is None:
        return None
    moved = [(a, b, d.name) for a, b, d in update.moved]
    added = [(row, list(out)) for row, _, _, out in update.added]
    return update.batch_size, list(update.removed), added, moved


@pytest.mark.xdist_group("processor-lockstep")
@SETTINGS
@given(workload=batch_steps())
def test_builtin_processors_match_upstream_through_batch_updates(up, counts, workload):
    vocab, steps = workload
    procs = _processor_pairs(up, vocab)
    batch = _Batch(up)
    next_id = 0
    for step_index, step in enumerate(steps):
        where = f"step {step_index}"
        live = [r for r in batch.rows if r is not None]
        for fraction in step["remove"]:
            if live:
                batch.remove(live.pop(min(int(fraction * len(live)), len(live) - 1)))
        for fields in step["add"]:
            if batch.num_reqs < MAX_REQS:
                params = up.SamplingParams(max_tokens=8, **fields)
                params.update_from_generation_config({}, eos_token_id=EOS)
                mini_params = SimpleNamespace(
                    min_p=params.min_p,
                    logit_bias=params.logit_bias,
                    min_tokens=params.min_tokens,
                    all_stop_token_ids=params.all_stop_token_ids,
                )
                batch.add(f"req{next_id}", (mini_params, params))
                next_id += 1
        batch.condense()
        num_reqs = batch.num_reqs
        for a, b in step["swaps"]:
            if num_reqs > 1:
                i, j = int(a * (num_reqs - 1)), int(b * (num_reqs - 1))
                if i != j:
                    batch.swap(i, j)
        mini_update, up_update = (b.get_and_reset(num_reqs) for b in batch.builders)
        assert _update_fields(mini_update) == _update_fields(up_update), where
        for _, _, direction in up_update.moved if up_update else ():
            key = f"sampling lockstep {direction.name} moves"
            counts[key] = counts.get(key, 0) + 1
        logits = torch.randn(
            num_reqs, vocab, generator=torch.Generator().manual_seed(step["logits_seed"])
        )
        for name, mini_proc, up_proc in procs:
            mini_proc.update_state(mini_update)
            up_proc.update_state(up_update)
            assert _state(name, mini_proc) == _state(name, up_proc), (
                f"{where}, {name}: state differs\nrows {batch.rows}"
            )
            assert mini_proc.is_argmax_invariant() == up_proc.is_argmax_invariant(), name
            if _state(name, up_proc) not in ({}, (0, [0.0] * MAX_REQS)):
                key = f"sampling lockstep steps with {name} state"
                counts[key] = counts.get(key, 0) + 1
            got = mini_proc.apply(logits.clone())
            want = up_proc.apply(logits.clone())
            diff = _first_row_diff(got, want)
            assert diff is None, f"{where}, {name}: {diff}\nrows {batch.rows}"
        # The step's sampled token joins every running request's output.
        for req_id in batch.rows:
            batch.outputs[req_id].append(step["token"])


@pytest.mark.xdist_group("processor-lockstep")
def test_generated_batch_steps_reach_moves_and_state(counts):
    """The processors' lockstep proves little unless rows really move while a
    processor holds state. Runs after the lockstep test in this module."""
    if not counts.get("sampling lockstep steps with MinPLogitsProcessor state"):
        pytest.skip("the processors' lockstep test did not run")
    for kind in ("UNIDIRECTIONAL moves", "SWAP moves"):
        assert counts.get(f"sampling lockstep {kind}", 0) > 0, counts
    for name in ("MinTokensLogitsProcessor", "LogitBiasLogitsProcessor"):
        assert counts.get(f"sampling lockstep steps with {name} state", 0) > 0, counts
