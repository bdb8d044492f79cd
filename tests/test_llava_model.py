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
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, AutoTokenizer, LlavaForConditionalGeneration

from mini_vllm.model_executor.model_loader import load_model
from mini_vllm.model_executor.model_loader.tiny_llava import TINY_IMAGE_TOKENS
from mini_vllm.multimodal.processing import LlavaMultiModalProcessor
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
