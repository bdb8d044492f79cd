"""Lab 04.3 — the split-KV decode merge (stage 2), a Triton kernel.

Graded: the ``LAB 04.3`` region of ``labs/phase_04/triton_decode_attention.py``
inside ``_decode_merge_kernel``. Stage 1 (``_decode_split_kernel``, the
reference's) leaves, for each (request, query head, split), the split's
running max m, sum l = sum exp(score - m) and unnormalised accumulator
acc = sum exp(score - m) * v; your code merges them into the attention
output. While a test runs, the reference module's ``_decode_merge_kernel``
is pointed at yours, so ``decode_attention`` and the engine's Triton backend
launch it.

On CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set
by phases/conftest.py before triton is imported); on CUDA it is compiled.

Oracles: ``merge_attn_states`` (torch, ops/merge_attn_states.py) folded over
the splits for the kernel alone; the torch backend (``TorchAttentionImpl``,
which tests/ check against HF transformers) for whole decode steps; greedy
tokens of HF transformers for the engine run.

Tolerances, |triton - torch| <= atol + rtol * |torch|, by dtype. Both sides
compute in float32 and round the output once to the dtype, so they differ by
float32 summation order (a few 1e-7) plus, in half precision, a rounding
flip of the output: at most one ulp, i.e. 2**-10 (float16) or 2**-7
(bfloat16) of the value. A flip can be a whole ulp because Triton's
interpreter truncates float32 -> bfloat16 instead of rounding to nearest.
Measured on this suite's shapes (8 seeds x contexts 1, 8, 21, 53 x splits
1, 3, 4, 9; ``python -m mini_vllm.benchmarks.attention --tolerances``, CPU
interpreter): float32 6.0e-7, float16 1.2e-4, bfloat16 1.56e-2 (one ulp of
a value in [2, 4)). The tolerances are twice the bound: rtol = 2 ulp, and an
atol for values near 0; float32 gets 2e-6 (3x the measurement). A wrong
merge (an empty split weighed, a missing rescale) errs by 1e-1 or more.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import triton
from triton.runtime.errors import InterpreterError

from mini_vllm.attention.backends.torch_attn import TorchAttentionImpl
from mini_vllm.attention.ops import triton_decode_attention as reference_module
from mini_vllm.attention.ops.merge_attn_states import merge_attn_states
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.testing import hf_greedy

pytestmark = pytest.mark.timeout(120)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {
    torch.float32: (2e-6, 1e-5),
    torch.float16: (1e-4, 2 * 2**-10),
    torch.bfloat16: (1e-3, 2 * 2**-7),
}
DTYPES = list(TOL)
DTYPE_IDS = [str(d).removeprefix("torch.") for d in DTYPES]


@contextlib.contextmanager
def your_kernel(impl):
    """Run the reference's launchers with your ``_decode_merge_kernel``, and
    turn the kernel's failures into messages."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            reference_module,
            "_decode_merge_kernel",
            impl.triton_decode_attention._decode_merge_kernel,
        )
        try:
            yield
        except InterpreterError as e:
            if "NotImplementedError" in str(e):  # the starter's raise, inside the kernel
                raise NotImplementedError(str(e)) from e
            raise AssertionError(f"Your kernel failed under Triton's interpreter: {e}") from e
        except triton.CompilationError as e:
            raise AssertionError(
                f"Your kernel does not compile for the GPU (a `raise` left in it, a Python "
                f"construct Triton does not support, or a shape error):\n{e}"
            ) from e


def partials(num_reqs, num_heads, num_splits, head_size, empty, seed, offset=0.0):
    """Random stage-1 results; the splits in ``empty`` (never 0) saw no key.
    ``offset`` shifts every max score (large logits)."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(num_reqs, num_heads, num_splits, generator=g) * 3 + offset
    sums = torch.rand(num_reqs, num_heads, num_splits, generator=g) * 5 + 0.5
    acc = torch.randn(num_reqs, num_heads, num_splits, head_size, generator=g) * sums[..., None]
    m[:, :, empty], sums[:, :, empty], acc[:, :, empty] = float("-inf"), 0.0, 0.0
    return m, sums, acc


def merged_by_torch(m, sums, acc):
    """Fold merge_attn_states over the splits: split s is the partial result
    (acc_s / l_s, lse_s = m_s + log l_s); an empty split has lse -inf."""
    R, H, S, D = acc.shape
    lse_s = m + torch.log(sums)  # empty: -inf + log 0 = -inf
    out_s = torch.where(sums[..., None] > 0, acc / sums.clamp_min(1e-30)[..., None], 0.0)
    out, lse = out_s[:, :, 0].clone(), lse_s[:, :, 0].T.clone()  # [R, H, D], [H, R]
    for s in range(1, S):
        merge_attn_states(out, out.clone(), lse.clone(), out_s[:, :, s], lse_s[:, :, s].T, lse)
    return out


@pytest.mark.points(1)
@pytest.mark.parametrize(
    "num_splits,empty",
    [(1, []), (2, [1]), (3, []), (5, [2, 4]), (8, [5, 6, 7])],
    ids=["1", "2-one-empty", "3-padded-to-4", "5-two-empty", "8-three-empty"],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_merge_kernel_on_stage1_partials(impl, num_splits, empty, dtype):
    R, H, D = 3, 4, 24  # D not a power of 2: HEAD_PAD = 32 with masked lanes
    # float32 only: max scores around 200, where exp(m) overflows float32.
    offset = 200.0 if dtype == torch.float32 else 0.0
    m, sums, acc = partials(R, H, num_splits, D, empty, seed=num_splits, offset=offset)
    want = merged_by_torch(m, sums, acc).to(dtype)
    qsl = torch.tensor([0, 2, 3, 5], dtype=torch.int32)  # request i writes row qsl[i]
    out = torch.full((6, H, D), 7.0, dtype=dtype, device=DEVICE)
    with your_kernel(impl):
        reference_module._decode_merge_kernel[(R, H)](
            out,
            qsl.to(DEVICE),
            acc.to(DEVICE),
            m.to(DEVICE),
            sums.to(DEVICE),
            H,
            num_splits,
            out.stride(0),
            out.stride(1),
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_SIZE=D,
            HEAD_PAD=32,
        )
    out = out.cpu()
    atol, rtol = TOL[dtype]
    if offset:
        # The torch fold goes through lse_s = m_s + log l_s near 200, whose float32
        # ulp is 1.5e-5: its weights carry that much rounding, so allow 1e-4.
        atol, rtol = 1e-4, 1e-4
    torch.testing.assert_close(
        out[qsl[:-1].long()],
        want,
        atol=atol,
        rtol=rtol,
        equal_nan=False,
        msg=lambda msg: (
            f"Merging {num_splits} splits (empty: {empty or 'none'}; SPLITS_PAD "
            f"{triton.next_power_of_2(num_splits)}; max scores around {offset:.0f}, so exp(m) "
            "alone would overflow float32) must give softmax over all the keys: with "
            "M = max_s m_s and w_s = exp(m_s - M), out = sum_s w_s acc_s / sum_s w_s l_s "
            f"(an empty split has w_s = 0), stored as {dtype}.\n{msg}"
        ),
    )
    untouched = [r for r in range(6) if r not in qsl[:-1].tolist()]
    assert (out[untouched] == 7.0).all(), (
        "Only row query_start_loc[req] of each request may be written."
    )


def decode_step(paged, layout, num_heads, num_kv_heads, head_size, block_size, dtype, seed):
    batch = paged(
        layout,
        num_heads,
        num_kv_heads,
        head_size,
        block_size,
        dtype=dtype,
        seed=seed,
        device=DEVICE,
    )
    cache = batch.kv_cache.to(DEVICE)
    torch_impl = TorchAttentionImpl(num_heads, head_size, head_size**-0.5, num_kv_heads)
    want = torch_impl.forward(
        batch.query.to(DEVICE), batch.key.to(DEVICE), batch.value.to(DEVICE), cache, batch.md
    )  # also stores the step
    return batch, cache, want


@pytest.mark.points(1)
@pytest.mark.parametrize("num_splits", [1, 3, 4, 9], ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_decode_attention_matches_torch_backend(impl, paged, dtype, num_splits):
    # Contexts of 1..53 keys in tiles of 16: with 9 splits most requests have
    # more splits than tiles (empty splits); GQA 6 query heads over 2 KV heads.
    layout = [(0, 1), (7, 1), (20, 1), (52, 1)]
    batch, cache, want = decode_step(paged, layout, 6, 2, 16, 4, dtype, seed=num_splits)
    out = torch.zeros_like(want)
    with your_kernel(impl):
        reference_module.decode_attention(
            out,
            batch.query.to(DEVICE),
            cache,
            batch.md.block_table,
            batch.md.seq_lens,
            batch.md.query_start_loc,
            batch.md.max_seq_len,
            16**-0.5,
            num_splits=num_splits,
            tile_n=16,
        )
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(
        out,
        want,
        atol=atol,
        rtol=rtol,
        msg=lambda msg: (
            f"decode_attention with num_splits={num_splits}, tile_n=16, {dtype}, "
            f"contexts {[c + 1 for c, _ in layout]} (GQA 6/2) differs from the torch backend "
            "beyond "
            f"the {dtype} tolerance (atol {atol}, rtol {rtol}; see the module docstring). Every "
            f"split's partial result must count by its weight exp(m_s - M), empty ones by 0.\n{msg}"
        ),
    )


@pytest.mark.points(5)
def test_engine_triton_backend_greedy_tokens(impl, tiny_llama):
    # The engine's Triton backend: prefills use the prefill kernel, every
    # decode step (max_query_len 1) the split-KV kernel with your merge.
    # decode_attention picks cdiv(max_seq_len, 32) splits (tiles of 32): the
    # 37-token prompt makes it 2, so the steps really merge splits (with
    # prompts under 32 keys there is one split and any merge that returns
    # acc / l would pass).
    path, hf = tiny_llama
    prompts = [[(7 * i + 13 * j) % 509 + 3 for j in range(3 + 17 * i)] for i in range(3)]
    with your_kernel(impl):
        llm = LLM(
            path,
            max_model_len=128,
            kv_cache_memory_bytes=4 << 20,
            block_size=8,
            max_num_batched_tokens=64,
            max_num_seqs=4,
            attention_backend="triton",
            device=DEVICE,
            dtype="float32",
        )  # "auto" is bfloat16 on CUDA; HF's is float32
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
            use_tqdm=False,
        )
    for prompt, out in zip(prompts, outs, strict=True):
        want = hf_greedy(hf, prompt, 5)
        assert out.outputs[0].token_ids == want, (
            f"With attention_backend='triton', greedy tokens for a prompt of {len(prompt)} tokens "
            f"are {out.outputs[0].token_ids}, HF transformers gives {want}. The first token comes "
            "from the prefill kernel; every later one from decode steps, i.e. your merge."
        )
