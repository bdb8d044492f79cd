"""LoRA on real weights: SmolLM2 with two seeded PEFT adapters, against transformers + peft.

The test makes two adapters with peft (different ranks, scalings and target
modules: A on q/v/o and the whole MLP, B on k/o/gate/down with rsLoRA), saves
them as PEFT folders, and runs transformers + peft greedily, one adapter at a
time. mini_vllm then serves one mixed batch (adapter A, adapter B, the base
model, A again on another prompt) with ``max_loras=2``: every request's
greedy tokens must equal transformers + peft's for its adapter. A second run
with ``max_loras=1`` and ``max_cpu_loras=1`` makes the scheduler hold
adapters back and the manager evict and reload them, with the same tokens.
Bad adapters (a rank above max_lora_rank, a module the model lacks, a missing
file, matrices shaped for another base model) fail their request with one
line, and the engine keeps serving.
"""

from __future__ import annotations

import json

import pytest
import torch

from mini_vllm.testing import hf_greedy

peft = pytest.importorskip("peft")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Hi"]
N_TOKENS = 6
ADAPTERS = {
    # name: (seed, LoraConfig keywords)
    "a": (
        1,
        {
            "r": 8,
            "lora_alpha": 16,
            "target_modules": ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        },
    ),
    "b": (
        2,
        {
            "r": 4,
            "lora_alpha": 8,
            "use_rslora": True,
            "target_modules": ["k_proj", "o_proj", "gate_proj", "down_proj"],
        },
    ),
}


def _randomize(model, seed: int) -> None:
    """Seeded adapter weights large enough to change the greedy tokens."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.05)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, smollm2_hf):
    """(GGUF path, prompt ids, the base model's greedy tokens, {name: (PEFT
    folder, {prompt: transformers + peft greedy tokens})})."""
    import copy

    from transformers import AutoTokenizer

    from mini_vllm.model_executor.model_loader.gguf_cache import cached_gguf

    path, shared = smollm2_hf
    cached = cached_gguf(path)  # the converted tokenizer, seconds faster than the GGUF's
    if cached is not None and cached[2] is not None:
        tok = AutoTokenizer.from_pretrained(str(cached[2]))
    else:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = copy.deepcopy(shared)  # peft edits the modules it wraps: never the shared model
    ids = {p: tok(p)["input_ids"] for p in PROMPTS}
    base = {p: hf_greedy(hf, ids[p], N_TOKENS) for p in PROMPTS}
    out = {}
    for name, (seed, kwargs) in ADAPTERS.items():
        config = peft.LoraConfig(lora_dropout=0.0, **kwargs)
        model = peft.get_peft_model(hf, config)
        _randomize(model, seed)
        folder = tmp_path_factory.mktemp(f"lora-{name}")
        model.save_pretrained(str(folder))
        model.eval()
        out[name] = (str(folder), {p: hf_greedy(model, ids[p], N_TOKENS) for p in PROMPTS})
        hf = model.unload()  # the base model again, for the next adapter
    return path, ids, base, out


def _run(llm, ids, requests):
    from mini_vllm.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids[p]} for p, _ in requests]
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=[r for _, r in requests])
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize(
    "slots",
    [
        {"max_loras": 2},
        # one slot, one adapter on the host: held back, evicted and reloaded
        pytest.param({"max_loras": 1, "max_cpu_loras": 1}, marks=pytest.mark.deep),
    ],
)
def test_mixed_batch_equals_transformers_peft(adapters, slots):
    from mini_vllm.entrypoints.llm import LLM
    from mini_vllm.lora.request import LoRARequest

    path, ids, base, out = adapters
    a = LoRARequest("a", 1, out["a"][0])
    b = LoRARequest("b", 2, out["b"][0])
    # The adapters change the tokens, or the test would prove nothing.
    assert out["a"][1] != base and out["b"][1] != base and out["a"][1] != out["b"][1]
    batch = [
        (PROMPTS[0], a),
        (PROMPTS[1], b),
        (PROMPTS[2], None),
        (PROMPTS[3], a),
        (PROMPTS[0], b),
        (PROMPTS[0], None),
    ]
    want = [base[p] if r is None else out[r.lora_name][1][p] for p, r in batch]
    llm = LLM(
        str(path),
        max_model_len=128,
        kv_cache_memory_bytes=16 << 20,
        enable_lora=True,
        max_lora_rank=8,
        **slots,
    )
    assert _run(llm, ids, batch) == want


def _write_adapter(folder, config: dict, tensors: dict) -> None:
    from safetensors.torch import save_file

    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "adapter_model.safetensors"))


def test_bad_adapters_fail_their_request_with_one_line(adapters, tmp_path):
    from mini_vllm.entrypoints.llm import LLM
    from mini_vllm.lora.request import LoRARequest

    path, ids, base, out = adapters
    llm = LLM(
        str(path),
        max_model_len=128,
        kv_cache_memory_bytes=16 << 20,
        enable_lora=True,
        max_lora_rank=8,
    )
    key = "base_model.model.model.layers.0.self_attn.{}.lora_{}.weight"
    config = {"r": 16, "lora_alpha": 16, "target_modules": ["q_proj"]}
    big = {
        key.format("q_proj", "A"): torch.zeros(16, 576),
        key.format("q_proj", "B"): torch.zeros(576, 16),
    }
    _write_adapter(tmp_path / "big", config, big)
    lm_head = {
        "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 576),
        "base_model.model.lm_head.lora_B.weight": torch.zeros(49152, 4),
    }
    _write_adapter(tmp_path / "head", {"r": 4, "lora_alpha": 4}, lm_head)
    wider = {  # q_proj of a base with hidden size 960 (SmolLM2-360M), not 576
        key.format("q_proj", "A"): torch.zeros(8, 960),
        key.format("q_proj", "B"): torch.zeros(960, 8),
    }
    _write_adapter(tmp_path / "other-base", {"r": 8, "lora_alpha": 8}, wider)
    cases = [
        (LoRARequest("big", 3, str(tmp_path / "big")), "rank r=16 is greater than max_lora_rank=8"),
        (
            LoRARequest("other-base", 6, str(tmp_path / "other-base")),
            r"q_proj.lora_A has shape \[8, 960\], but this base model needs \[8, 576\]",
        ),
        (LoRARequest("head", 4, str(tmp_path / "head")), r"target modules \['lm_head'\]"),
        (LoRARequest("gone", 5, str(tmp_path / "gone")), "no file adapter_config.json"),
    ]
    for request, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            _run(llm, ids, [(PROMPTS[0], request)])
        assert "\n" not in str(info.value)
    # and the engine keeps serving, the base model and a good adapter alike
    a = LoRARequest("a", 1, out["a"][0])
    assert _run(llm, ids, [(PROMPTS[0], None), (PROMPTS[1], a)]) == [
        base[PROMPTS[0]],
        out["a"][1][PROMPTS[1]],
    ]
