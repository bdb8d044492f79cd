"""Lab 04.2 — paged attention in torch: store, gather, mask, GQA.

Graded: the two ``LAB 04.2`` regions of ``labs/phase_04/torch_attn.py``
(``TorchAttentionImpl.forward``): storing the step's keys and values at
their slots (what ``reshape_and_cache`` does), and, per request, gathering
its keys and values back through its block table, giving query head h the
KV head h // group, and the causal mask of a chunk over cached context.

The oracle is attention from its definition, in float64, over the same keys
and values kept unpaged (``dense_attention`` in ``phase04_helpers.py``); the batches
use shuffled block ids, partial last blocks and NaN in every slot that holds no token. At the
end your backend runs a tiny Llama through the engine and must produce
HuggingFace transformers' greedy tokens.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mini_vllm.entrypoints.llm import LLM
from mini_vllm.grading.checks import lab_settings
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.testing import hf_greedy
from mini_vllm.worker import gpu_worker

from phase04_helpers import dense_attention

pytestmark = pytest.mark.timeout(60)
PROPERTY = lab_settings(40, shrink=True)


def run(impl, batch, num_heads, num_kv_heads, head_size):
    backend = impl.torch_attn.TorchAttentionImpl(
        num_heads, head_size, head_size**-0.5, num_kv_heads
    )
    return backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.md)


def describe(batch, num_heads, num_kv_heads, block_size) -> str:
    return (
        f"requests (cached context, new tokens) {batch.layout}, block_size {block_size}, "
        f"{num_heads} query heads / {num_kv_heads} KV heads, block table "
        f"{batch.md.block_table.tolist()}"
    )


def check(out, batch, num_heads, num_kv_heads, head_size, block_size, rule):
    want = dense_attention(batch, head_size**-0.5)
    assert not out.isnan().any(), (
        f"NaN in the output: a key or value was read from a slot that holds no token (every "
        f"such slot is NaN). {rule} {describe(batch, num_heads, num_kv_heads, block_size)}"
    )
    torch.testing.assert_close(
        out.double(),
        want,
        atol=1e-5,
        rtol=1e-5,
        msg=lambda m: f"{rule} {describe(batch, num_heads, num_kv_heads, block_size)}\n{m}",
    )


@pytest.mark.points(3)
@pytest.mark.parametrize("block_size", [4, 16])
def test_store_writes_each_token_at_its_slot(impl, paged, block_size):
    batch = paged([(5, 3), (0, 7), (9, 1)], 2, 2, 8, block_size, seed=1)
    before = batch.kv_cache.clone()
    run(impl, batch, 2, 2, 8)
    slots = batch.md.slot_mapping.tolist()
    for t, slot in enumerate(slots):
        block, offset = slot // block_size, slot % block_size
        for kv, name, src in ((0, "key", batch.key), (1, "value", batch.value)):
            assert torch.equal(batch.kv_cache[block, kv, offset], src[t]), (
                f"Token {t}'s {name} belongs at slot {slot} = block {block} * block_size "
                f"{block_size} + offset {offset}, i.e. kv_cache[{block}, {kv}, {offset}] "
                f"(index 1 is 0 for keys, 1 for values). Found "
                f"{batch.kv_cache[block, kv, offset].flatten()[:4].tolist()}..., expected "
                f"{src[t].flatten()[:4].tolist()}..."
            )
    written = torch.zeros(batch.kv_cache.shape[0] * block_size, dtype=torch.bool)
    written[slots] = True
    written = written.view(-1, block_size)
    untouched = batch.kv_cache.transpose(1, 2)[~written]
    assert torch.equal(untouched.isnan(), before.transpose(1, 2)[~written].isnan()), (
        "Only the slots in slot_mapping may be written: another slot of the cache changed."
    )


@pytest.mark.points(3)
@pytest.mark.parametrize("block_size", [4, 8])
def test_decode_batch(impl, paged, block_size):
    # One new token per request; contexts end mid-block (partial last blocks).
    batch = paged([(0, 1), (6, 1), (13, 1), (31, 1)], 4, 4, 16, block_size, seed=2)
    out = run(impl, batch, 4, 4, 16)
    check(
        out,
        batch,
        4,
        4,
        16,
        block_size,
        "Decode: each request's one query sees all of its seq_len keys, gathered in position "
        "order through its block table (position j: block_table[i, j // block_size], offset "
        "j % block_size), and nothing past seq_len.",
    )


@pytest.mark.points(3)
def test_prefill_chunks_over_cached_context(impl, paged):
    # A chunk of q_len new tokens after ctx cached ones: new token r sits at
    # position ctx + r and sees keys 0 .. ctx + r.
    batch = paged([(0, 9), (7, 5), (16, 3), (3, 1)], 2, 2, 8, 4, seed=3)
    out = run(impl, batch, 2, 2, 8)
    check(
        out,
        batch,
        2,
        2,
        8,
        4,
        "Causality over cached context: the new tokens are the LAST q_len positions of "
        "seq_len, so row r (position seq_len - q_len + r) sees key positions 0 .. "
        "seq_len - q_len + r: all of the cached context and its own causal part.",
    )


@pytest.mark.points(3)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (6, 2), (4, 1), (8, 2)])
def test_gqa_query_head_reads_kv_head_h_div_group(impl, paged, num_heads, num_kv_heads):
    batch = paged([(5, 3), (10, 1)], num_heads, num_kv_heads, 8, 4, seed=4)
    out = run(impl, batch, num_heads, num_kv_heads, 8)
    group = num_heads // num_kv_heads
    check(
        out,
        batch,
        num_heads,
        num_kv_heads,
        8,
        4,
        f"GQA: query head h reads KV head h // group (group = {num_heads} // {num_kv_heads} = "
        f"{group}): heads {list(range(num_heads))} -> KV heads "
        f"{[h // group for h in range(num_heads)]}. repeat_interleave gives that order; repeat "
        f"gives h % num_kv_heads.",
    )


@pytest.mark.points(4)
@PROPERTY
@given(
    layout=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12)), min_size=1, max_size=4),
    heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3), (6, 2)]),
    head_size=st.sampled_from([4, 8, 12]),
    block_size=st.sampled_from([1, 2, 4, 8, 16]),
    seed=st.integers(0, 10_000),
)
def test_any_batch_matches_dense_attention(impl, paged, layout, heads, head_size, block_size, seed):
    num_heads, num_kv_heads = heads
    batch = paged(layout, num_heads, num_kv_heads, head_size, block_size, seed=seed)
    out = run(impl, batch, num_heads, num_kv_heads, head_size)
    check(
        out,
        batch,
        num_heads,
        num_kv_heads,
        head_size,
        block_size,
        "A mixed batch (prefill chunks with and without context, decodes) must equal dense "
        "causal attention over the unpaged keys and values.",
    )


@pytest.mark.points(4)
@pytest.mark.timeout(120)
def test_engine_greedy_tokens_equal_transformers(impl, tiny_llama, monkeypatch):
    # Your backend runs every attention layer of a tiny Llama (4 query heads,
    # 2 KV heads) in mini_vllm's engine: block size 4, a token budget of 8
    # (prompts are prefilled in chunks over their cached context), then decode.

    path, hf = tiny_llama
    student = impl.torch_attn.TorchAttentionImpl
    monkeypatch.setattr(gpu_worker, "get_attn_backend", lambda name: student)
    # float32 on every device: "auto" would pick bfloat16 on CUDA, and HF's
    # reference tokens are float32.
    llm = LLM(
        path,
        max_model_len=128,
        kv_cache_memory_bytes=4 << 20,
        block_size=4,
        max_num_batched_tokens=8,
        max_num_seqs=4,
        attention_backend="torch",
        device="cuda" if torch.cuda.is_available() else "cpu",
        dtype="float32",
    )
    assert type(llm.llm_engine.model.attention_layers()[0].impl) is student
    prompts = [[(7 * i + 13 * j) % 509 + 3 for j in range(3 + 7 * i)] for i in range(4)]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
        use_tqdm=False,
    )
    for prompt, out in zip(prompts, outs, strict=True):
        want = hf_greedy(hf, prompt, 6)
        assert out.outputs[0].token_ids == want, (
            f"Greedy tokens through the engine with your backend differ from HuggingFace "
            f"transformers' for a prompt of {len(prompt)} tokens: got "
            f"{out.outputs[0].token_ids}, expected {want}. The unit tests above find the rule."
        )
