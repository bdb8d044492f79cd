"""Images in chat messages (Phase 13): OpenAI ``image_url`` parts with data URLs.

For the tiny seeded LLaVA (model_loader/tiny_llava.py), a chat message whose
content holds an ``image_url`` part (a base64 PNG data URL: nothing is
fetched) runs the image: ``LLM.chat`` and the server's
``/v1/chat/completions`` give transformers' greedy tokens for the same
conversation rendered with ``<image>`` in front of the text, as upstream
places it. A URL that is not a data URL, a data URL that is not an image, and
more ``<image>`` marks than images fail that request alone (a 400 from the
server), which then serves the next request.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, LlavaForConditionalGeneration

from mini_vllm.engine.async_llm import AsyncLLM
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.entrypoints.openai.api_server import ServerThread
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.testing import make_tiny_llava

N = 6
MODEL_NAME = "tiny-llava"


def png_data_url(seed: int) -> tuple[str, Image.Image]:
    pixels = np.random.RandomState(seed).randint(0, 256, size=(30, 34, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode(), image


def image_message(url: str, text: str) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": text},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        }
    ]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = str(make_tiny_llava(tmp_path_factory.mktemp("tiny_llava_serve"), seed=1))
    hf = LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(folder)
    engine = AsyncLLM.from_model(folder, model_name=MODEL_NAME)
    server = ServerThread(engine, folder, MODEL_NAME)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    yield folder, hf, processor, client
    server.stop()


def hf_chat_greedy(hf, processor, text: str, image: Image.Image, n: int) -> list[int]:
    """transformers' tokens for one user turn: ``<image>`` on its own line before
    the text, through the tokenizer's chat template, then its processor."""
    conversation = [{"role": "user", "content": f"<image>\n{text}"}]
    rendered = processor.tokenizer.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=False
    )
    # the template's text, tokenized as the engine does (no special tokens added)
    inputs = processor(images=[image], text=rendered, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        return hf.generate(**inputs, max_new_tokens=n, do_sample=False)[0, -n:].tolist()


def test_llm_chat_runs_image_parts(setup):
    folder, hf, processor, _ = setup
    url, image = png_data_url(0)
    want = hf_chat_greedy(hf, processor, "What is this?", image, N)
    llm = LLM(folder)
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    got = llm.chat(image_message(url, "What is this?"), params, use_tqdm=False)
    assert list(got[0].outputs[0].token_ids) == want


def test_server_chat_runs_image_parts(setup):
    folder, hf, processor, client = setup
    url, image = png_data_url(2)
    want = processor.tokenizer.decode(hf_chat_greedy(hf, processor, "Describe it.", image, N))
    got = client.chat.completions.create(
        model=MODEL_NAME,
        messages=image_message(url, "Describe it."),
        temperature=0,
        max_tokens=N,
        extra_body={"ignore_eos": True},
    )
    assert got.choices[0].message.content == want


@pytest.mark.parametrize(
    "url, text, error",
    [
        ("https://example.com/cat.png", "hi", "only data URLs"),
        ("data:image/png;base64," + base64.b64encode(b"not a png").decode(), "hi", "not an image"),
        (None, "<image> <image>", "more '<image>' placeholders"),
    ],
    ids=["remote-url", "not-an-image", "too-many-marks"],
)
def test_bad_image_parts_are_a_400_and_the_server_serves_on(setup, url, text, error):
    _, _, _, client = setup
    if url is None:
        url = png_data_url(3)[0]
    with pytest.raises(openai.BadRequestError, match=error):
        client.chat.completions.create(
            model=MODEL_NAME, messages=image_message(url, text), max_tokens=2
        )
    ok = client.chat.completions.create(
        model=MODEL_NAME, messages=image_message(png_data_url(4)[0], "hi"), max_tokens=2
    )
    assert ok.choices[0].finish_reason in ("length", "stop")
