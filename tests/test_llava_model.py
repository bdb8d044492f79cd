"""A vision-language model (Phase 13): mini_vllm's LLaVA equal to transformers'.

The model is a tiny seeded LLaVA checkpoint (model_loader/tiny_llava.py:
a 3-layer CLIP tower of which layer -2 is read, a projector, a 3-layer
Llama; SmolLM2's tokenizer plus ``<image>``), built in the test, with images
made in the test with numpy and PIL. transformers' own
``LlavaForConditionalGeneration`` and ``LlavaProcessor`` on the same folder
are the reference:

- the processor: the same expanded token ids and pixel values as
  transformers' processor, a ``PlaceholderRange`` per image where its image
  tokens are, and the image's hash as its identifier (equal images share it);
- the model: the tower and projector give transformers' image features;
- through the engine: greedy tokens equal transformers' on prompts with
  images, alone and batched with text-only prompts, with a token budget that
  makes prefill chunks cut through an image (the second chunk reads the
  image's encoder output from the runner's cache), and with a shared image
  encoded once;
- bad input fails that request with one clear ValueError, and the engine
  serves the next request;
- deep tier: under preemption, async scheduling and n-gram speculation too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, AutoTokenizer, LlavaForConditionalGeneration

from mini_vllm.entrypoints.llm import LLM
from mini_vllm.model_executor.model_loader import load_model
from mini_vllm.model_executor.model_loader.tiny_llava import TINY_IMAGE_TOKENS
from mini_vllm.multimodal.processing import LlavaMultiModalProcessor
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.testing import make_tiny_llava

N = 8  # tokens generated per prompt


def make_image(seed: int, width: int = 40, height: int = 36) -> Image.Image:
    """A random RGB image (its size differs from the tower's 32 x 32: the
    image processor resizes and crops it)."""
    pixels = np.random.RandomState(seed).randint(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory):
    folder = make_tiny_llava(tmp_path_factory.mktemp("tiny_llava"), seed=0)
    hf = LlavaForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32).eval()
    return str(folder), hf, AutoProcessor.from_pretrained(str(folder))


def hf_greedy_mm(hf, processor, text: str, images: list, n: int) -> list[int]:
    """transformers' greedy tokens after ``text`` with ``images``: its processor
    expands the prompt, its model merges the image features, then a plain
    loop over its own KV cache (no EOS handling)."""
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


def test_processor_matches_transformers(tiny_llava):
    """Expanded ids and pixel values as transformers' processor makes them; one
    placeholder range per image, over its image tokens; the hash is the image's."""
    folder, hf, processor = tiny_llava
    tok = AutoTokenizer.from_pretrained(folder)
    mini = LlavaMultiModalProcessor.from_pretrained(folder, hf.config)
    images = [make_image(1), make_image(2, 50, 30)]
    text = "USER: <image>\nand <image>: what differs?"
    expected = processor(images=images, text=text, return_tensors="pt")

    out = mini.apply(tok.encode(text), {"image": images})

    assert out.prompt_token_ids == expected["input_ids"][0].tolist()
    pixels = torch.stack([f.data["pixel_values"] for f in out.mm_features])
    assert torch.equal(pixels, expected["pixel_values"])
    image_token = hf.config.image_token_index
    for feature in out.mm_features:
        pos = feature.mm_position
        assert pos.length == TINY_IMAGE_TOKENS
        assert out.prompt_token_ids[pos.offset : pos.offset + pos.length] == [image_token] * 16
    assert [f.modality for f in out.mm_features] == ["image", "image"]
    # The hash follows the pixels: the same image again shares it, another does not.
    again = mini.apply(tok.encode(text), {"image": [make_image(1), make_image(3)]})
    assert again.mm_features[0].identifier == out.mm_features[0].identifier
    assert again.mm_features[1].identifier != out.mm_features[1].identifier


def test_tower_and_projector_equal_transformers(tiny_llava):
    """embed_multimodal: transformers' image features (second-to-last tower layer,
    class vector dropped, projected), from mini_vllm's own tower built 2 layers deep."""
    folder, hf, processor = tiny_llava
    model = load_model(folder, load_tokenizer=False).model
    assert len(model.vision_tower.vision_model.encoder.layers) == 2
    pixel_values = processor.image_processor(
        images=[make_image(4), make_image(5)], return_tensors="pt"
    )["pixel_values"]
    with torch.no_grad():
        mini = torch.stack(model.embed_multimodal(pixel_values=pixel_values))
        # transformers 5 returns a model output whose pooler_output lists the images' features
        features = hf.get_image_features(pixel_values=pixel_values).pooler_output
        expected = torch.stack(list(features))
    assert mini.shape == (2, TINY_IMAGE_TOKENS, hf.config.text_config.hidden_size)
    torch.testing.assert_close(mini, expected.reshape(mini.shape), rtol=1e-5, atol=1e-5)


def count_encoded_images(model) -> list[int]:
    """Wrap ``model.embed_multimodal`` to count the images it encodes, per call."""
    counts: list[int] = []
    inner = model.embed_multimodal

    def counting(pixel_values):
        counts.append(len(pixel_values))
        return inner(pixel_values=pixel_values)

    model.embed_multimodal = counting
    return counts


def record_merged_pieces(runner) -> list[int]:
    """Wrap the runner's ``_gather_mm_embeddings`` to record how many rows of
    an image each step merges (fewer than the image's: a chunk cut through it)."""
    pieces: list[int] = []
    inner = runner._gather_mm_embeddings

    def recording(scheduler_output):
        mm_embeds, is_mm_embed = inner(scheduler_output)
        pieces.extend(len(e) for e in mm_embeds)
        return mm_embeds, is_mm_embed

    runner._gather_mm_embeddings = recording
    return pieces


PROMPTS = [
    ("USER: <image>\nWhat is in the picture?", [make_image(10)]),
    ("Tell me a story about the sea", []),
    ("USER: <image> and <image>\nCompare them.", [make_image(11), make_image(12, 64, 48)]),
    # The first image again, in another prompt: its hash is shared.
    ("Look: <image>", [make_image(10)]),
]


def mm_prompt(text: str, images: list) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else {"prompt": text}


@pytest.mark.parametrize(
    "budget",
    [
        pytest.param(None, id="whole-prompts"),
        # 10 tokens a step: every image prompt's chunks cut through its image.
        pytest.param(10, id="chunks-cut-images"),
    ],
)
def test_greedy_equals_transformers(tiny_llava, budget):
    folder, hf, processor = tiny_llava
    expected = [hf_greedy_mm(hf, processor, text, images, N) for text, images in PROMPTS]
    # The image decides tokens: another image in the same prompt gives others.
    other = hf_greedy_mm(hf, processor, PROMPTS[0][0], [make_image(99)], N)
    assert other != expected[0]

    kwargs = {} if budget is None else {"max_num_batched_tokens": budget, "max_num_seqs": 4}
    llm = LLM(model=folder, **kwargs)
    runner = llm.llm_engine.engine_core.model_runner
    encoded = count_encoded_images(runner.model)
    pieces = record_merged_pieces(runner)
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    outputs = llm.generate([mm_prompt(t, imgs) for t, imgs in PROMPTS], params)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    if budget is None:
        # Four images, three distinct: the shared one was encoded once.
        assert encoded == [3]
        assert set(pieces) == {TINY_IMAGE_TOKENS}
    else:
        # Chunks cut through images: some steps merged only part of one.
        assert min(pieces) < TINY_IMAGE_TOKENS
    # Alone, the first prompt says the same (its blocks now come from the
    # prefix cache); with another image, the same tokens share no cached
    # block with it (the image's hash is in the block hashes).
    alone = llm.generate(mm_prompt(*PROMPTS[0]), params)
    assert list(alone[0].outputs[0].token_ids) == expected[0]
    swapped = llm.generate(mm_prompt(PROMPTS[0][0], [make_image(99)]), params)
    assert list(swapped[0].outputs[0].token_ids) == other
    # The runner keeps exactly the encoder outputs the scheduler's encoder
    # cache still holds: the others were freed through free_encoder_mm_hashes.
    manager = llm.llm_engine.engine_core.scheduler.encoder_cache_manager
    assert set(runner.encoder_cache) == set(manager.cached)


@pytest.mark.deep
def test_greedy_equals_transformers_under_preemption(tiny_llava):
    """Deep tier: few KV blocks, so requests are preempted and recomputed; their
    images are encoded again when they come back, and the tokens still equal
    transformers'."""
    folder, hf, processor = tiny_llava
    prompts = PROMPTS + [
        ("<image><image><image> three of them", [make_image(20), make_image(21), make_image(10)]),
        ("USER: describe <image> briefly please", [make_image(22, 80, 20)]),
    ]
    expected = [hf_greedy_mm(hf, processor, text, images, 24) for text, images in prompts]
    llm = LLM(
        model=folder,
        block_size=4,
        num_gpu_blocks_override=40,
        max_model_len=128,
        max_num_batched_tokens=24,
        max_num_seqs=6,
    )
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate([mm_prompt(t, imgs) for t, imgs in prompts], params)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    assert llm.llm_engine.engine_core.num_preemptions > 0


@pytest.mark.deep
@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {"async_scheduling": True, "max_num_batched_tokens": 10, "max_num_seqs": 4},
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    ],
    ids=["async-chunked", "ngram-spec"],
)
def test_greedy_equals_transformers_async_and_speculative(tiny_llava, engine_kwargs):
    """Deep tier: the same tokens under async scheduling (the encoder inputs
    scheduled a step ahead) and with n-gram drafts verified after the images."""
    folder, hf, processor = tiny_llava
    expected = [hf_greedy_mm(hf, processor, text, images, 12) for text, images in PROMPTS]
    llm = LLM(model=folder, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([mm_prompt(t, imgs) for t, imgs in PROMPTS], params)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected


def test_bad_images_fail_that_request(tiny_llava):
    folder, hf, processor = tiny_llava
    llm = LLM(model=folder)
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    with pytest.raises(ValueError, match=r"multi_modal_data\['image'\]\[0\] is not an image"):
        llm.generate({"prompt": "<image>", "multi_modal_data": {"image": "cat.png"}}, params)
    with pytest.raises(ValueError, match="2 image placeholder token.* for 1 image"):
        llm.generate(
            {"prompt": "<image><image>", "multi_modal_data": {"image": make_image(1)}}, params
        )
    with pytest.raises(ValueError, match="0 image placeholder token.* for 1 image"):
        llm.generate({"prompt": "hello", "multi_modal_data": {"image": [make_image(1)]}}, params)
    with pytest.raises(ValueError, match="unsupported modality 'audio'"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"audio": b"..."}}, params)
    # The engine serves the next request as if nothing happened.
    text, images = PROMPTS[0]
    out = llm.generate(mm_prompt(text, images), params)
    assert list(out[0].outputs[0].token_ids) == hf_greedy_mm(hf, processor, text, images, N)


def test_image_larger_than_the_encoder_cache_is_refused(tiny_llava):
    """An item with more embeddings than the encoder cache holds could never be
    scheduled: the input processor refuses it (upstream's check and words)."""
    folder, _, _ = tiny_llava
    llm = LLM(model=folder)
    processor = llm.llm_engine.input_processor
    processor.mm_encoder_cache_size = TINY_IMAGE_TOKENS - 1
    with pytest.raises(ValueError, match="16 embedding tokens, which exceeds the pre-allocated"):
        processor.process_inputs(
            "big", {"prompt": "<image>", "multi_modal_data": {"image": make_image(1)}}, None
        )
