"""``--lora-modules name=path``: the server serves each adapter as a model (issue 34).

A real server (``ServerThread``) over the tiny seeded Llama with one seeded
PEFT adapter on q_proj and down_proj, driven by the official ``openai``
client. ``/v1/models`` lists the adapter after the base model; a request
naming the adapter gets the text ``LLM.generate(..., lora_request=...)`` gives
offline, one naming the base model the base model's text (and the two differ,
or the test would prove nothing).
"""

from __future__ import annotations

import json

import openai
import pytest
import torch
from serve_helpers import tiny_text_model

from mini_vllm.engine.async_llm import AsyncLLM
from mini_vllm.entrypoints import cli
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.entrypoints.openai.api_server import LoRAModulePath, ServerThread
from mini_vllm.lora.request import LoRARequest
from mini_vllm.sampling_params import SamplingParams

MODEL_NAME = "tiny-llama"
ENGINE_ARGS = dict(
    max_model_len=128, num_gpu_blocks_override=64, device="cpu", enable_lora=True, max_lora_rank=8
)
PROMPT = "The capital of France is"


def _write_adapter(folder, model_path: str) -> str:
    """A seeded rank-4 PEFT adapter for every layer's q_proj and down_proj."""
    from safetensors.torch import save_file

    config = json.loads(open(f"{model_path}/config.json").read())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    g = torch.Generator().manual_seed(11)
    tensors = {}
    key = "base_model.model.model.layers.{}.{}.lora_{}.weight"
    for layer in range(config["num_hidden_layers"]):
        for module, d_in, d_out in [
            ("self_attn.q_proj", hidden, hidden),
            ("mlp.down_proj", inter, hidden),
        ]:
            tensors[key.format(layer, module, "A")] = torch.randn(4, d_in, generator=g)
            tensors[key.format(layer, module, "B")] = torch.randn(d_out, 4, generator=g)
    folder.mkdir()
    adapter = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "down_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps(adapter))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return str(folder)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = tiny_text_model()
    adapter = _write_adapter(tmp_path_factory.mktemp("lora") / "sea", model)
    engine = AsyncLLM.from_model(model, model_name=MODEL_NAME, **ENGINE_ARGS)
    server = ServerThread(engine, model, MODEL_NAME, [LoRAModulePath("sea", adapter)])
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    yield model, adapter, client
    server.stop()


def test_models_lists_the_adapter_with_its_base(setup):
    _, adapter, client = setup
    cards = client.models.list().data
    assert [c.id for c in cards] == [MODEL_NAME, "sea"]
    assert (cards[1].root, cards[1].parent) == (adapter, MODEL_NAME)


def test_a_request_naming_the_adapter_runs_it(setup):
    model, adapter, client = setup
    llm = LLM(model, **{k: v for k, v in ENGINE_ARGS.items() if k != "num_gpu_blocks_override"})
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want_base, want_sea = (
        llm.generate(PROMPT, params, use_tqdm=False, lora_request=lora)[0].outputs[0].text
        for lora in (None, LoRARequest("sea", 1, adapter))
    )
    assert want_base != want_sea  # the adapter changes the text
    for name, want in [(MODEL_NAME, want_base), ("sea", want_sea)]:
        got = client.completions.create(
            model=name, prompt=PROMPT, temperature=0, max_tokens=10, extra_body={"ignore_eos": True}
        )
        assert (got.model, got.choices[0].text) == (name, want)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-adapter", prompt=PROMPT, max_tokens=2)


def test_a_chat_naming_the_adapter_runs_it(setup):
    model, adapter, client = setup
    llm = LLM(model, **{k: v for k, v in ENGINE_ARGS.items() if k != "num_gpu_blocks_override"})
    messages = [{"role": "user", "content": "Name a colour."}]
    # LLM.chat's rendering, with the adapter (LLM.chat takes none)
    ids = llm.get_tokenizer().apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = (
        llm.generate(
            {"prompt_token_ids": ids},
            params,
            use_tqdm=False,
            lora_request=LoRARequest("sea", 1, adapter),
        )[0]
        .outputs[0]
        .text
    )
    assert want != llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
    got = client.chat.completions.create(
        model="sea",
        messages=messages,
        temperature=0,
        max_tokens=10,
        extra_body={"ignore_eos": True},
    )
    assert (got.model, got.choices[0].message.content) == ("sea", want)


def test_lora_modules_parse_and_need_enable_lora(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--lora-modules", "no-equals-sign"])
    assert e.value.code == 2
    assert "expected name=path, got 'no-equals-sign'" in capsys.readouterr().err
    code = cli.main(["serve", tiny_text_model(), "--lora-modules", f"a={tmp_path}"])
    assert code == 2
    assert (
        capsys.readouterr().err == "mini-vllm serve: error: --lora-modules needs --enable-lora.\n"
    )


def test_a_bad_adapter_stops_start_up_with_one_line(tmp_path):
    """An adapter made for another base model (q_proj 8 columns wider than
    this model's hidden size) or a folder without its files: the server does
    not start, and the error is one line naming the adapter."""
    from safetensors.torch import save_file

    model = tiny_text_model()
    hidden = json.loads(open(f"{model}/config.json").read())["hidden_size"]
    wider = tmp_path / "wider"
    wider.mkdir()
    (wider / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 4}))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    tensors = {key.format("A"): torch.ones(4, hidden + 8), key.format("B"): torch.ones(hidden, 4)}
    save_file(tensors, str(wider / "adapter_model.safetensors"))
    engine = AsyncLLM.from_model(model, model_name=MODEL_NAME, **ENGINE_ARGS)
    try:
        for path, message in [
            (wider, rf"q_proj.lora_A has shape \[4, {hidden + 8}\], but this base model needs"),
            (tmp_path / "gone", "no file adapter_config.json"),
        ]:
            with pytest.raises(ValueError, match=message) as info:
                ServerThread(engine, model, MODEL_NAME, [LoRAModulePath("bad", str(path))])
            assert "\n" not in str(info.value)
    finally:
        engine.shutdown()
