"""Lab 13.4's fixtures.

- ``tiny_llava``: a tiny seeded LLaVA checkpoint written into a temporary
  folder (mini_vllm/model_executor/model_loader/tiny_llava.py);
- ``transformers_tokens``: the greedy tokens transformers' own
  ``LlavaForConditionalGeneration`` gives on the lab's prompts from that
  folder (computed once, for both tests, after your engine has run: a
  region not written yet fails the test before transformers is loaded).
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory) -> str:
    from mini_vllm.testing import make_tiny_llava

    return str(make_tiny_llava(tmp_path_factory.mktemp("tiny_llava"), seed=0))


@pytest.fixture(scope="module")
def transformers_tokens(tiny_llava) -> list[list[int]]:
    import torch
    from test_lab04_vlm_real_run import MAX_TOKENS, PROMPTS, hf_greedy
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    hf = LlavaForConditionalGeneration.from_pretrained(tiny_llava, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(tiny_llava)
    return [hf_greedy(hf, processor, text, images, MAX_TOKENS) for text, images in PROMPTS]
