"""Prompts given as embeddings (Phase 13): ``{"prompt_embeds": tensor [T, hidden]}``.

With ``enable_prompt_embeds=True``, as upstream's offline API takes them: the
runner feeds the tensor's rows to the model instead of looking up token ids.
On a tiny seeded Llama, with embeddings that are no token's (a token's plus
noise), mini_vllm's greedy tokens equal transformers' run on the same
``inputs_embeds``: alone, batched with token prompts, with prefill chunks
cutting through them. Two embedding prompts of the same length have the same
placeholder ids (zeros): their blocks' hashes carry the embeddings
(upstream's ``_gen_prompt_embeds_extra_hash_keys``), so prefix caching never
serves one the other's KV. Bad input fails that request with one clear error.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from mini_vllm.entrypoints.llm import LLM
from mini_vllm.model_executor.model_loader.tiny import make_tiny_model
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.testing import hf_greedy

N = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("tiny_llama_pe"), arch="llama", seed=0)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return str(folder), hf


def noisy_embeds(hf, ids: list[int], seed: int) -> torch.Tensor:
    """The ids' embeddings plus noise: rows no token id has."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        embeds = hf.get_input_embeddings()(torch.tensor(ids))
    return embeds + 0.3 * torch.randn(embeds.shape, generator=generator)


def hf_greedy_embeds(hf, embeds: torch.Tensor, n: int) -> list[int]:
    """transformers' greedy tokens after a prompt given as ``inputs_embeds``."""
    with torch.no_grad():
        out = hf(inputs_embeds=embeds[None], use_cache=True)
        tokens = []
        for _ in range(n):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = hf(
                input_ids=torch.tensor([[tokens[-1]]]),
                past_key_values=out.past_key_values,
                use_cache=True,
            )
    return tokens


IDS = [[(7 * j) % 500 + 3 for j in range(21)], [(3 * j) % 500 + 5 for j in range(9)]]


@pytest.mark.parametrize("budget", [None, 8], ids=["whole", "chunked"])
def test_prompt_embeds_equal_transformers(tiny, budget):
    folder, hf = tiny
    embeds = [noisy_embeds(hf, IDS[0], 0), noisy_embeds(hf, IDS[0], 1), noisy_embeds(hf, IDS[1], 2)]
    expected = [hf_greedy_embeds(hf, e, N) for e in embeds]
    # The two prompts of the same length differ only by their embeddings, and
    # so do their tokens: a block shared between them would show.
    assert expected[0] != expected[1]
    kwargs = {} if budget is None else {"max_num_batched_tokens": budget, "max_num_seqs": 4}
    llm = LLM(folder, enable_prompt_embeds=True, block_size=4, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    prompts = [
        {"prompt_embeds": embeds[0]},
        {"prompt_token_ids": IDS[1]},
        {"prompt_embeds": embeds[1]},
        {"prompt_embeds": embeds[2][None]},  # a batch of one is squeezed
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outputs]
    assert got == [expected[0], hf_greedy(hf, IDS[1], N), expected[1], expected[2]]
    # Again, with the first prompt's blocks cached: still its own tokens.
    again = llm.generate([{"prompt_embeds": embeds[1]}], params, use_tqdm=False)
    assert list(again[0].outputs[0].token_ids) == expected[1]


def test_bad_prompt_embeds_fail_that_request(tiny):
    folder, hf = tiny
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    embeds = noisy_embeds(hf, IDS[1], 0)
    with pytest.raises(ValueError, match="enable_prompt_embeds=True"):
        LLM(folder).generate({"prompt_embeds": embeds}, params, use_tqdm=False)
    llm = LLM(folder, enable_prompt_embeds=True)
    with pytest.raises(ValueError, match=r"shape \(seq_len, hidden_size\)"):
        llm.generate({"prompt_embeds": embeds[0]}, params, use_tqdm=False)
    with pytest.raises(ValueError, match="hidden size 32; the model's is 64"):
        llm.generate({"prompt_embeds": embeds[:, :32]}, params, use_tqdm=False)
    with pytest.raises(ValueError, match="must be a float torch.Tensor"):
        llm.generate({"prompt_embeds": [[0.0] * 64]}, params, use_tqdm=False)
    out = llm.generate({"prompt_embeds": embeds}, params, use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == hf_greedy_embeds(hf, embeds, 2)
