"""Lab 13.4 — a real run: a tiny LLaVA through your whole Phase 13.

No new code: every Phase 13 region is yours (the ``phase`` marker). Your
Scheduler (``scheduler_cls``) runs on your EncoderCacheManager; the runner
is your GPUModelRunner (your ``_gather_mm_embeddings``) and the model merges
the image rows with your ``merge_multimodal_embeddings``. mini_vllm's engine
then generates greedily on a tiny seeded LLaVA checkpoint (a 3-layer CLIP
tower, a projector, a 3-layer Llama; 16 embeddings per image) for four
prompts: an image, text only, two images, and the first image again in
another prompt (its hash is shared, so it is encoded once). Images are made
here with numpy and PIL.

The tokens must equal transformers' own ``LlavaForConditionalGeneration``
greedy tokens on the same folder, token for token:

1. with a token budget that takes every prompt whole, all four in one batch
   (the shared image encoded once);
2. with a 10-token budget, so that prefill chunks cut through every image:
   the second chunk of an image reads its encoder output from the runner's
   cache, and your code must take only the chunk's part of it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from mini_vllm.grading.checks import written

pytestmark = [pytest.mark.phase, pytest.mark.timeout(600)]
MAX_TOKENS = 8
IMAGE_EMBEDS = 16  # the tiny tower's patches: image tokens per image


def make_image(seed: int, width: int = 40, height: int = 36) -> Image.Image:
    pixels = np.random.RandomState(seed).randint(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


PROMPTS = [
    ("USER: <image>\nWhat is in the picture?", [make_image(10)]),
    ("Tell me a story about the sea", []),
    ("USER: <image> and <image>\nCompare them.", [make_image(11), make_image(12, 64, 48)]),
    ("Look: <image>", [make_image(10)]),
]


def hf_greedy(hf, processor, text: str, images: list, n: int) -> list[int]:
    """transformers' greedy tokens: its processor expands the prompt, its
    model merges the image features, then a loop over its own KV cache."""
    if images:
        inputs = processor(images=images, text=text, return_tensors="pt")
    else:
        inputs = processor.tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        out = hf(**inputs, use_cache=True)
        tokens = []
        for _ in range(n):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = hf(
                input_ids=torch.tensor([[tokens[-1]]]),
                past_key_values=out.past_key_values,
                use_cache=True,
            )
    return tokens


def every_region_written(impl) -> None:
    """Call each Phase 13 piece once on a tiny input, so that a region not
    written yet fails the test at once, before a model is built."""
    from types import SimpleNamespace

    import mini_vllm.testing as mini
    from mini_vllm.oracle.workload import RequestSpec, Workload, run_workload

    written(
        impl.llava.merge_multimodal_embeddings,
        torch.zeros(2, 1),
        [torch.ones(1, 1)],
        torch.tensor([False, True]),
    )
    (request,) = mini.create_requests(1, num_tokens=8, mm_items=[[[2, 4, "x", None]]])
    cache = impl.encoder_cache_manager.EncoderCacheManager(4)
    for method, *args in [
        ("check_and_update_cache", 0),
        ("can_allocate", 0, 4, 0),
        ("allocate", 0),
        ("free_encoder_input", 0),
        ("get_freed_mm_hashes",),
    ]:
        written(getattr(cache, method), *([request] if args else []), *args)
    nobody = SimpleNamespace(input_batch=SimpleNamespace(req_ids=[]), requests={}, encoder_cache={})
    step = SimpleNamespace(num_scheduled_tokens={}, total_num_scheduled_tokens=0)
    written(impl.gpu_model_runner.GPUModelRunner._gather_mm_embeddings, nobody, step)
    probe = Workload(
        "probe",
        {"block_size": 4, "num_blocks": 16, "max_model_len": 16, "mm_max_tokens_per_item": 4},
        [RequestSpec("a", [1, 2, 3, 3, 3, 3, 4], max_tokens=2, mm_items=[[2, 4, "x", None]])],
    )
    scheduler = mini.create_scheduler(scheduler_cls=impl.scheduler.Scheduler, **probe.config)
    written(run_workload, mini, probe, scheduler=scheduler)


def run_your_engine(impl, folder: str, **engine_kwargs):
    """(greedy tokens per prompt, images encoded per encoder call, rows merged
    per image piece) through an engine built from your Phase 13 pieces."""
    from mini_vllm.core.sched import scheduler as ref_scheduler
    from mini_vllm.engine import core
    from mini_vllm.entrypoints.llm import LLM
    from mini_vllm.model_executor.models import llava
    from mini_vllm.sampling_params import SamplingParams

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            ref_scheduler, "EncoderCacheManager", impl.encoder_cache_manager.EncoderCacheManager
        )
        mp.setattr(core, "GPUModelRunner", impl.gpu_model_runner.GPUModelRunner)
        mp.setattr(llava, "merge_multimodal_embeddings", impl.llava.merge_multimodal_embeddings)
        llm = LLM(model=folder, scheduler_cls=impl.scheduler.Scheduler, **engine_kwargs)
        engine_core = llm.llm_engine.engine_core
        assert type(engine_core.scheduler) is impl.scheduler.Scheduler
        assert type(engine_core.scheduler.encoder_cache_manager) is (
            impl.encoder_cache_manager.EncoderCacheManager
        )
        assert type(engine_core.model_runner) is impl.gpu_model_runner.GPUModelRunner
        model = engine_core.model_runner.model
        encoded: list[int] = []
        inner_encode = model.embed_multimodal

        def counting(pixel_values):
            encoded.append(len(pixel_values))
            return inner_encode(pixel_values=pixel_values)

        model.embed_multimodal = counting
        runner = engine_core.model_runner
        pieces: list[int] = []
        inner_gather = runner._gather_mm_embeddings

        def recording(scheduler_output):
            mm_embeds, is_mm_embed = inner_gather(scheduler_output)
            pieces.extend(len(e) for e in mm_embeds)
            return mm_embeds, is_mm_embed

        runner._gather_mm_embeddings = recording
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        prompts = [
            {"prompt": t, "multi_modal_data": {"image": imgs}} if imgs else {"prompt": t}
            for t, imgs in PROMPTS
        ]
        outputs = written(llm.generate, prompts, params)
    return [list(o.outputs[0].token_ids) for o in outputs], encoded, pieces


def compare(tokens, expected, how: str) -> None:
    for i, (got, want) in enumerate(zip(tokens, expected, strict=True)):
        text, images = PROMPTS[i]
        assert got == want, (
            f"{how}: prompt {i} ({text!r}, {len(images)} image(s)) gave tokens {got}, "
            f"transformers' greedy tokens are {want}. The first differing token is at output "
            f"{next(k for k, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)}. "
            "Image rows merged at the wrong positions, from the wrong image or the wrong part "
            "of it (Lab 13.3), or an image the scheduler never sent to the encoder (Lab 13.1) "
            "change what the model sees."
        )


@pytest.mark.points(10)
def test_whole_prompts_batched_with_text_equal_transformers(impl, request):
    every_region_written(impl)
    tokens, encoded, pieces = run_your_engine(impl, request.getfixturevalue("tiny_llava"))
    expected = request.getfixturevalue("transformers_tokens")
    compare(tokens, expected, "whole prompts, one batch")
    assert encoded == [3], (
        f"four images, three distinct (the first prompt's image comes back in the fourth): "
        f"the encoder must run once, on the three, in one batch; it ran on {encoded} images "
        "per call. A shared image is taken from the encoder cache (Labs 13.1, 13.2)."
    )
    assert set(pieces) == {IMAGE_EMBEDS}, pieces


@pytest.mark.points(10)
def test_chunks_that_cut_images_equal_transformers(impl, request):
    every_region_written(impl)
    tokens, _, pieces = run_your_engine(
        impl, request.getfixturevalue("tiny_llava"), max_num_batched_tokens=10, max_num_seqs=4
    )
    expected = request.getfixturevalue("transformers_tokens")
    compare(tokens, expected, "10-token chunks cutting through the images")
    assert pieces and min(pieces) < IMAGE_EMBEDS, (
        f"with 10-token chunks some step must merge only part of an image; the pieces merged "
        f"had {pieces} rows"
    )
