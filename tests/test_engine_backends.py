"""The engine with attention_backend="triton" or "cpu" against "torch" (the reference).

On CPU the Triton kernels run under Triton's interpreter (conftest.py sets
TRITON_INTERPRET=1), which is slow, so the CPU tests use the tiny seeded
models and a handful of tokens. They still cover what the kernels see in
the engine: chunked prefill (a token budget of 8, so a prompt's prefill is
cut across steps and attends to its own cached chunks), decode steps mixed
with prefills, paged blocks (block size 8), and a prefix-cache hit (the
second prompt of a pair starts from blocks the first one computed).

The ``gpu`` class runs SmolLM2-135M compiled on CUDA:

- float32: mini_vllm with the Triton backend must produce the greedy tokens
  of HuggingFace transformers in float32 on the same GPU (the prefill
  kernel multiplies float32 in IEEE precision, not TF32, so both sides
  agree to ~1e-6 and a greedy choice flips only at a near-exact tie);
- bfloat16: compared backend to backend (Triton vs torch, both bfloat16)
  rather than against float32, because bfloat16 rounding (8-bit mantissa)
  moves the logits of a 135M model by ~1e-2 and flips close greedy choices
  after a few tokens whichever attention runs. The two backends also round
  differently from each other (summation order; the prefill kernel rounds
  its softmax weights to bfloat16 before P @ V), so the test accepts a
  difference only where it starts at a near tie: the first token where the
  two disagree must be one whose log-probabilities, per the torch backend,
  are within ``BF16_TIE_NATS`` of each other; the tokens before it must be
  equal.
"""

from __future__ import annotations

import pytest
import torch
from hf_reference import PROMPTS, hf_greedy
from transformers import AutoModelForCausalLM

from mini_vllm.attention.backends.cpu_attn import CPUAttentionBackendImpl
from mini_vllm.attention.backends.torch_attn import TorchAttentionImpl
from mini_vllm.attention.backends.triton_attn import TritonAttentionImpl
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.model_executor.model_loader import smollm2_gguf_path
from mini_vllm.model_executor.model_loader.tiny import make_tiny_model
from mini_vllm.sampling_params import SamplingParams

IMPLS = {
    "torch": TorchAttentionImpl,
    "triton": TritonAttentionImpl,
    "cpu": CPUAttentionBackendImpl,
}


def greedy(n: int, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=logprobs)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


# ------------------------------------------------- CPU: tiny models, interpreted

TINY_PROMPTS = [[(7 * i + 13 * j) % 509 + 3 for j in range(3 + 9 * i)] for i in range(4)]
SHARED = [(5 * j + 3) % 509 + 3 for j in range(37)]  # 4 full blocks of 8, then 5 tokens
PAIR = [SHARED + [11, 12], SHARED + [13]]
N = 6


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"tiny_{request.param}_backends")
    make_tiny_model(folder, arch=request.param, seed=0)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    hf.eval()
    return str(folder), hf


def run_tiny(path: str, backend: str) -> tuple[list[list[int]], dict]:
    llm = LLM(
        path,
        max_model_len=128,
        kv_cache_memory_bytes=8 << 20,
        block_size=8,
        max_num_batched_tokens=8,
        max_num_seqs=4,
        attention_backend=backend,
    )
    layers = llm.llm_engine.model.attention_layers()
    assert all(type(layer.impl) is IMPLS[backend] for layer in layers)
    outs = llm.generate([{"prompt_token_ids": p} for p in TINY_PROMPTS], greedy(N), use_tqdm=False)
    # The pair one after the other, so that the second finds the first's blocks cached.
    for prompt in PAIR:
        outs += llm.generate([{"prompt_token_ids": prompt}], greedy(N), use_tqdm=False)
    return token_ids(outs), llm.llm_engine.get_stats()


@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_tiny_backend_matches_torch_backend(tiny, backend):
    path, hf = tiny
    torch_tokens, _ = run_tiny(path, "torch")
    tokens, stats = run_tiny(path, backend)
    assert tokens == torch_tokens
    # Both equal transformers too, so the comparison is not between two wrong answers.
    for prompt, tokens in zip(TINY_PROMPTS + PAIR, torch_tokens, strict=True):
        assert tokens == hf_greedy(hf, prompt, N)
    assert stats["num_steps"] > N + len(TINY_PROMPTS), "prefills should have been chunked"
    assert stats["prefix_cache_hits"] >= 32, stats  # the second of the pair reused 4 blocks


def test_cpu_is_the_default_backend_on_cpu(tiny):
    path, _ = tiny
    llm = LLM(path, max_model_len=64, kv_cache_memory_bytes=4 << 20, device="cpu")
    assert llm.llm_engine.attention_backend == "cpu"
    layers = llm.llm_engine.model.attention_layers()
    assert all(type(layer.impl) is CPUAttentionBackendImpl for layer in layers)


# ----------------------------------------- CPU: SmolLM2, the batched backends


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_smollm2_cpu_backends_match_transformers(backend, smollm2_hf):
    """Eight prompts decoding together (a batched decode of 8 rows) after chunked prefills.
    transformers' SmolLM2 (fp32) is the session's (tests/conftest.py), loaded once."""
    path, hf = smollm2_hf
    llm = LLM(
        str(path),
        device="cpu",
        attention_backend=backend,
        max_model_len=256,
        kv_cache_memory_bytes=64 << 20,
        max_num_batched_tokens=48,
        max_num_seqs=8,
    )
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS[:8]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(10), use_tqdm=False)
    for prompt, tokens in zip(prompts, token_ids(outs), strict=True):
        assert tokens == hf_greedy(hf, prompt, 10), backend


# ------------------------------------------------------- GPU: SmolLM2, compiled

GPU_PROMPTS = PROMPTS
GPU_N = 12
# bfloat16 logits of SmolLM2 carry ~1e-2 of rounding noise; two tokens whose
# log-probabilities are closer than this may swap between backends.
BF16_TIE_NATS = 0.1


def smollm2_llm(backend: str, dtype: str) -> LLM:
    return LLM(
        str(smollm2_gguf_path()),
        device="cuda",
        dtype=dtype,
        attention_backend=backend,
        max_model_len=512,
        kv_cache_memory_bytes=256 << 20,
        max_num_batched_tokens=64,
        max_num_seqs=16,
    )  # chunked prefill on long prompts


@pytest.mark.gpu
class TestSmolLM2OnCuda:
    @pytest.fixture(scope="class")
    def hf_fp32(self):
        path = smollm2_gguf_path()
        hf = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).to("cuda")
        hf.eval()
        return hf

    def test_triton_float32_matches_transformers_float32(self, hf_fp32):
        assert not torch.backends.cuda.matmul.allow_tf32  # a true float32 reference
        llm = smollm2_llm("triton", "float32")
        tok = llm.get_tokenizer()
        prompts = [tok.encode(p) for p in GPU_PROMPTS]
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], greedy(GPU_N), use_tqdm=False
        )
        for prompt, got in zip(prompts, token_ids(outs), strict=True):
            assert got == hf_greedy(hf_fp32, prompt, GPU_N), tok.decode(prompt)

    def test_triton_bfloat16_matches_torch_backend_bfloat16(self):
        runs = {}
        for backend in ("torch", "triton"):
            llm = smollm2_llm(backend, "bfloat16")
            assert llm.llm_engine.model.attention_layers()[0].impl.__class__ is IMPLS[backend]
            runs[backend] = [
                o.outputs[0]
                for o in llm.generate(GPU_PROMPTS, greedy(GPU_N, logprobs=5), use_tqdm=False)
            ]
            del llm
            torch.cuda.empty_cache()
        identical = 0
        for prompt, ref, got in zip(GPU_PROMPTS, runs["torch"], runs["triton"], strict=True):
            if got.token_ids == ref.token_ids:
                identical += 1
                continue
            i = next(
                i
                for i, (a, b) in enumerate(zip(ref.token_ids, got.token_ids, strict=False))
                if a != b
            )
            top = ref.logprobs[i]  # the torch backend's top-5 at the first difference
            assert got.token_ids[i] in top, (prompt, i, ref.token_ids, got.token_ids)
            gap = top[ref.token_ids[i]] - top[got.token_ids[i]]
            assert gap < BF16_TIE_NATS, (prompt, i, gap, ref.token_ids, got.token_ids)
        # Near ties are the exception: most prompts agree on every token.
        assert identical >= len(GPU_PROMPTS) - 2, identical
