"""Lab 13.3 — the encoder's rows into the token embeddings.

Graded: the ``LAB 13.3`` regions of ``labs/phase_13/llava.py``
(``merge_multimodal_embeddings``: overwrite the rows of the step's token
embeddings where the mask is True with the encoder rows, in order, in place)
and of ``labs/phase_13/gpu_model_runner.py`` (``_gather_mm_embeddings``: for
each request of the batch, the rows of each image's encoder output that the
step's chunk covers, and the mask of the step's token positions they go to;
an ``is_embed`` mask keeps only its True positions).

Against upstream's own functions, live on the CPU:
``_merge_multimodal_embeddings`` (vllm/model_executor/models/utils.py:456) and
``GPUModelRunner._gather_mm_embeddings``
(vllm/v1/worker/gpu_model_runner.py:3071), each called with the same inputs
as yours. ``_gather_mm_embeddings`` runs on a stand-in runner holding only
what it reads: ``input_batch.req_ids`` (batch order), ``requests`` (each with
``num_computed_tokens`` and ``mm_features``) and ``encoder_cache``
(identifier -> encoder output). Last, the two together: a prompt prefilled
in chunks that cut through its images, each chunk gathered and merged by
your code, must give the embeddings upstream's merge gives the whole prompt
in one step.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mini_vllm.grading.checks import lab_settings, written
from mini_vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

pytestmark = pytest.mark.upstream
HIDDEN = 4


def upstream_merge():
    from vllm.model_executor.models.utils import _merge_multimodal_embeddings

    return _merge_multimodal_embeddings


def upstream_gather():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return GPUModelRunner._gather_mm_embeddings


# ------------------------------------------------------------------ merging


@st.composite
def merge_cases(draw):
    """(inputs_embeds, the pieces, the mask): the pieces' rows add up to the
    mask's True positions, split at random; the pieces may be float64."""
    seed = draw(st.integers(0, 2**16), label="seed")
    mask = draw(st.lists(st.booleans(), min_size=1, max_size=24), label="mask")
    n = sum(mask)
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=4), label="cuts"))
    bounds = [0, *cuts, n]
    dtype = draw(st.sampled_from([torch.float32, torch.float64]), label="dtype of the pieces")
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randn(len(mask), HIDDEN, generator=g)
    rows = torch.randn(n, HIDDEN, generator=g, dtype=dtype)
    pieces = [rows[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a or n == 0]
    return inputs, pieces, torch.tensor(mask, dtype=torch.bool)


@pytest.mark.points(6)
def test_merge_matches_upstream(impl, up):
    merge = upstream_merge()

    @lab_settings(40, shrink=True)
    @given(case=merge_cases())
    def run(case):
        inputs, pieces, mask = case
        want = merge(inputs.clone(), [p.clone() for p in pieces], mask.clone())
        mine = inputs.clone()
        got = written(impl.llava.merge_multimodal_embeddings, mine, list(pieces), mask)
        where = (
            f"{len(mask)} tokens, mask {mask.int().tolist()}, pieces of "
            f"{[len(p) for p in pieces]} rows ({pieces[0].dtype if pieces else 'none'})"
        )
        assert got.dtype == want.dtype and torch.equal(got, want), (
            f"merge_multimodal_embeddings differs from upstream's on {where}: the i-th True "
            "position of the mask takes the i-th row of the pieces concatenated, other rows "
            "keep their token embedding, and the result keeps inputs_embeds' dtype."
        )
        assert torch.equal(mine, want), (
            f"on {where}: the rows must be written into inputs_embeds itself (in place), as "
            "upstream does: the caller keeps using that tensor."
        )

    run()


@pytest.mark.points(2)
def test_merge_refuses_a_count_that_does_not_match(impl, up):
    inputs = torch.zeros(6, HIDDEN)
    mask = torch.tensor([False, True, True, False, True, False])
    pieces = [torch.ones(2, HIDDEN), torch.ones(2, HIDDEN)]
    with pytest.raises(ValueError):
        upstream_merge()(inputs.clone(), pieces, mask)
    try:
        written(impl.llava.merge_multimodal_embeddings, inputs.clone(), pieces, mask)
    except ValueError:
        return
    except RuntimeError as e:
        pytest.fail(
            f"4 rows for 3 placeholders: upstream raises ValueError (saying both counts); "
            f"yours let torch's RuntimeError out: {e}",
            pytrace=False,
        )
    pytest.fail(
        "4 rows for 3 placeholders: upstream raises ValueError (saying both counts); yours "
        "raised nothing",
        pytrace=False,
    )


# ------------------------------------------------------------------ gathering


@st.composite
def prompts(draw):
    """(prompt length, images as [offset, length, identifier, mask or None]),
    from a pool of three images (same identifier, same length and mask)."""
    pool = []
    for j in range(3):
        length = draw(st.integers(1, 6), label="placeholders")
        mask = None
        if draw(st.booleans(), label="masked"):
            mask = draw(st.lists(st.booleans(), min_size=length, max_size=length), label="mask")
        pool.append((f"img{j}", length, mask))
    items, pos = [], 0
    for _ in range(draw(st.integers(0, 3), label="images")):
        pos += draw(st.integers(0, 4), label="text")
        ident, length, mask = draw(st.sampled_from(pool), label="image")
        items.append([pos, length, ident, mask])
        pos += length
    return pos + draw(st.integers(1, 4), label="tail"), items, pool


def encoder_outputs(pool, seed: int) -> dict[str, torch.Tensor]:
    """Each image's encoder output: one random row per embedding."""
    g = torch.Generator().manual_seed(seed)
    return {
        ident: torch.randn(length if mask is None else sum(mask), HIDDEN, generator=g)
        for ident, length, mask in pool
    }


def features(items, upstream: bool) -> list:
    if upstream:
        from vllm.multimodal.inputs import MultiModalFeatureSpec as Spec
        from vllm.multimodal.inputs import PlaceholderRange as Range
    else:
        Spec, Range = MultiModalFeatureSpec, PlaceholderRange
    return [
        Spec(
            data=None,
            modality="image",
            identifier=ident,
            mm_position=Range(
                offset, length, None if mask is None else torch.tensor(mask, dtype=torch.bool)
            ),
        )
        for offset, length, ident, mask in items
    ]


def stand_in_runner(batch, cache, upstream: bool):
    """What _gather_mm_embeddings reads of a runner. ``batch``: (req_id, its
    images, num_computed_tokens, num_scheduled_tokens) in batch order."""
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=[r for r, *_ in batch]),
        requests={
            r: SimpleNamespace(num_computed_tokens=c, mm_features=features(items, upstream))
            for r, items, c, _ in batch
        },
        encoder_cache=cache,
        device=torch.device("cpu"),
        # upstream's: no multimodal pruning, no M-RoPE here
        is_multimodal_pruning_enabled=False,
        uses_mrope=False,
    )
    out = SimpleNamespace(
        num_scheduled_tokens={r: n for r, _, _, n in batch},
        total_num_scheduled_tokens=sum(n for *_, n in batch),
    )
    return runner, out


def gather_both(impl, batch, cache):
    want = upstream_gather()(*stand_in_runner(batch, cache, upstream=True))
    got = written(
        impl.gpu_model_runner.GPUModelRunner._gather_mm_embeddings,
        *stand_in_runner(batch, cache, upstream=False),
    )
    return got, want


def describe(batch) -> str:
    return "; ".join(
        f"{r}: images (offset, placeholders, identifier, is_embed) {items}, "
        f"{c} tokens computed, {n} scheduled this step"
        for r, items, c, n in batch
    )


@st.composite
def batches(draw):
    batch, pools = [], []
    for k in range(draw(st.integers(1, 4), label="requests")):
        length, items, pool = draw(prompts())
        computed = draw(st.integers(0, length - 1), label="computed")
        scheduled = draw(st.integers(1, length - computed), label="scheduled")
        # Identifiers per request: requests here do not share images.
        items = [[o, n, f"r{k}-{i}", m] for o, n, i, m in items]
        pools += [(f"r{k}-{i}", n, m) for i, n, m in pool]
        batch.append((f"r{k}", items, computed, scheduled))
    return batch, encoder_outputs(pools, draw(st.integers(0, 2**16), label="seed"))


@pytest.mark.points(10)
@pytest.mark.timeout(300)
def test_gather_matches_upstream(impl, up):
    @lab_settings(60, shrink=True)
    @given(case=batches())
    def run(case):
        batch, cache = case
        (got_embeds, got_mask), (want_embeds, want_mask) = gather_both(impl, batch, cache)
        where = f"a step with {describe(batch)}"
        assert got_mask.dtype == torch.bool and got_mask.tolist() == want_mask.tolist(), (
            f"is_mm_embed differs on {where}:\n  upstream: {want_mask.int().tolist()}\n  yours:  "
            f"  {got_mask.int().tolist()}\nOne entry per token scheduled this step, requests in "
            "batch order; True where the token takes an encoder row (inside an image's "
            "placeholders, and where its is_embed mask is True)."
        )
        assert [len(e) for e in got_embeds] == [len(e) for e in want_embeds], (
            f"on {where}: the pieces have {[len(e) for e in got_embeds]} rows, upstream's "
            f"{[len(e) for e in want_embeds]}: one piece per image the chunk overlaps (none for "
            "an image with no embedding in the overlap), in batch and prompt order."
        )
        for k, (g, w) in enumerate(zip(got_embeds, want_embeds, strict=True)):
            assert torch.equal(g, w), (
                f"on {where}: piece {k} holds other rows of the encoder output than upstream's: "
                "a chunk covering placeholder positions [start, end) of an image takes rows "
                "get_embeds_indices_in_range(start, end) of its output."
            )

    run()


@pytest.mark.points(7)
@pytest.mark.timeout(300)
def test_chunks_that_cut_images_give_the_whole_prompts_embeddings(impl, up):
    merge = upstream_merge()

    @lab_settings(30, shrink=True)
    @given(prompt=prompts(), data=st.data())
    def run(prompt, data):
        length, items, pool = prompt
        cache = encoder_outputs(pool, 7)
        g = torch.Generator().manual_seed(length)
        token_embeds = torch.randn(length, HIDDEN, generator=g)
        # Upstream: the whole prompt in one step.
        embeds, mask = upstream_gather()(*stand_in_runner([("r", items, 0, length)], cache, True))
        want = merge(token_embeds.clone(), embeds, mask)
        # Yours: chunk by chunk.
        chunks, done = [], 0
        while done < length:
            n = data.draw(st.integers(1, length - done), label="chunk")
            chunks.append(n)
            runner, out = stand_in_runner([("r", items, done, n)], cache, False)
            embeds, mask = written(
                impl.gpu_model_runner.GPUModelRunner._gather_mm_embeddings, runner, out
            )
            piece = written(
                impl.llava.merge_multimodal_embeddings,
                token_embeds[done : done + n].clone(),
                embeds,
                mask,
            )
            assert torch.equal(piece, want[done : done + n]), (
                f"a {length}-token prompt with images (offset, placeholders, identifier, "
                f"is_embed) {items}, prefilled in chunks {chunks}: the chunk of positions "
                f"[{done}, {done + n}) merged by your code differs from those rows of the "
                "whole prompt merged at once by upstream. A chunk that cuts an image takes "
                "only its part of the image's rows; the next chunk takes the rest."
            )
            done += n

    run()
