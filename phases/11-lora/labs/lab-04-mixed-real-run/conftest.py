"""Lab 11.4's fixture: SmolLM2 with two seeded PEFT adapters, and transformers
+ peft's greedy tokens for each.

``peft_adapters`` builds the two adapters tests/test_lora_engine.py builds
(same seeds, ranks, scalings and target modules: A rank 8 on q/v/o and the
whole MLP; B rank 4 with rsLoRA on k/o/gate/down), saves each as a PEFT folder
(adapter_config.json + adapter_model.safetensors), and runs transformers +
peft greedily on every prompt, one adapter at a time, and the base model. One
transformers load serves them all.
"""

from __future__ import annotations

import pytest
import torch
from phase11_helpers import ADAPTERS, N_TOKENS, PROMPTS, randomize_lora


@pytest.fixture(scope="module")
def peft_adapters(tmp_path_factory):
    """(GGUF path, {prompt: ids}, {prompt: base greedy tokens}, {name: (PEFT
    folder, {prompt: transformers + peft greedy tokens})})."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mini_vllm.model_executor.model_loader import smollm2_gguf_path
    from mini_vllm.model_executor.model_loader.gguf_cache import cached_gguf
    from mini_vllm.testing import hf_greedy

    path = smollm2_gguf_path()
    cached = cached_gguf(path)  # the converted tokenizer, seconds faster than the GGUF's
    if cached is not None and cached[2] is not None:
        tok = AutoTokenizer.from_pretrained(str(cached[2]))
    else:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    ids = {p: tok(p)["input_ids"] for p in PROMPTS}
    base = {p: hf_greedy(hf, ids[p], N_TOKENS) for p in PROMPTS}
    out = {}
    for name, (seed, kwargs) in ADAPTERS.items():
        model = peft.get_peft_model(hf, peft.LoraConfig(lora_dropout=0.0, **kwargs))
        randomize_lora(model, seed)
        folder = tmp_path_factory.mktemp(f"lora-{name}")
        model.save_pretrained(str(folder))
        model.eval()
        out[name] = (str(folder), {p: hf_greedy(model, ids[p], N_TOKENS) for p in PROMPTS})
        hf = model.unload()  # the base model again, for the next adapter
    return path, ids, base, out
