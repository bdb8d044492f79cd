"""Lab 11.4 — one LoRA layer for a whole batch, and the mixed real run.

Graded: the ``LAB 11.4`` regions of ``labs/phase_11/layers.py``
(``BaseLinearLayerWithLoRA.set_lora``: one adapter's matrices into a slot,
zero-padded to the stacks' rank; ``forward``: the base output plus every
row's adapter) and of ``labs/phase_11/punica_cpu.py``
(``PunicaWrapperCPU.add_shrink``, ``add_expand``, ``add_lora_linear``: shrink
every shard into float32 buffers, then expand each into its columns).

First, marked ``upstream``, against the pinned upstream's own classes on a
CPU: ``set_lora`` against upstream's ``BaseLinearLayerWithLoRA.set_lora``
(vllm/lora/layers/base_linear.py:157) on a bare linear layer, slot by slot;
``add_lora_linear`` against upstream's ``PunicaWrapperCPU.add_lora_linear``
(vllm/lora/punica_wrapper/punica_cpu.py:265) on generated mixed batches
(adapters and rows without one, q/k/v shards); ``forward`` as the base
layer plus upstream's ``add_lora_linear``.

Then, marked ``phase`` (every Phase 11 region is yours): SmolLM2-135M with two
seeded PEFT adapters (conftest.py) served by an engine built from your
Scheduler (11.1), your ops (11.2), your adapter manager and ``InputBatch``
(11.3) and your layers and wrapper (11.4). One mixed batch (adapter A,
adapter B, the base model, each on several prompts) must give, request for
request, the greedy tokens transformers + peft give for that request's
adapter: once with ``max_loras=2`` and once with ``max_loras=1,
max_cpu_loras=1``, where your scheduler holds adapters back and your manager
evicts and reloads them.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from phase11_helpers import N_TOKENS, PROMPTS, every_lab_written, plug_into_engine, written

from mini_vllm.grading.checks import lab_settings

CASES = lab_settings(40)


def _base(d_in: int, sizes: tuple[int, ...]) -> torch.nn.Module:
    base = torch.nn.Linear(d_in, sum(sizes), bias=False)
    base.input_size, base.output_sizes = d_in, sizes
    return base


def _upstream_layer(max_loras: int, rank: int, d_in: int, d_out: int):
    """Upstream's own LoRA layer stacks on a bare ReplicatedLinear (no model, no TP)."""
    from vllm.config.lora import LoRAConfig
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA
    from vllm.model_executor.layers.linear import ReplicatedLinear

    layer = BaseLinearLayerWithLoRA.__new__(BaseLinearLayerWithLoRA)
    torch.nn.Module.__init__(layer)
    layer.base_layer = ReplicatedLinear.__new__(ReplicatedLinear)
    layer.input_size, layer.output_size, layer.device = d_in, d_out, "cpu"
    layer.n_slices, layer.tp_size = 1, 1
    config = LoRAConfig(max_lora_rank=rank, max_loras=max_loras, lora_dtype=torch.float32)
    layer.create_lora_weights(max_loras, config)
    return layer


@pytest.mark.upstream
@pytest.mark.points(3)
@CASES
@given(
    max_rank=st.sampled_from([8, 16]),
    ranks=st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=5),
    slots=st.lists(st.integers(0, 2), min_size=5, max_size=5),
    seed=st.integers(0, 1000),
)
def test_set_lora_fills_a_slot_as_upstreams_layer(impl, max_rank, ranks, slots, seed):
    d_in, d_out, max_loras = 12, 10, 3
    up = _upstream_layer(max_loras, max_rank, d_in, d_out)
    ours = impl.layers.BaseLinearLayerWithLoRA(_base(d_in, (d_out,)))
    ours.create_lora_weights(max_loras, max_rank, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    done = []
    for rank, slot in zip(ranks, slots, strict=False):
        a, b = torch.randn(rank, d_in, generator=g), torch.randn(d_out, rank, generator=g)
        up.set_lora(slot, a, b)
        written(ours.set_lora, slot, [a], [b])
        done.append((slot, rank))
        for name in ("lora_a_stacked", "lora_b_stacked"):
            want, got = getattr(up, name)[0], getattr(ours, name)[0][:max_loras]
            bad = [s for s in range(max_loras) if not torch.equal(want[s], got[s])]
            assert not bad, (
                f"{name} slot {bad[0]} differs from upstream's after set_lora calls (slot, rank) "
                f"{done} (max_lora_rank {max_rank}): a slot takes the adapter's matrices in its "
                "first rank rows (lora_a) or columns (lora_b) and zeros elsewhere, whatever "
                "a larger adapter left there before (reset_lora first)."
            )


@st.composite
def batches(draw):
    """(each token's adapter id, 0 for none; the slot order): 1-3 slots, up to
    one free, and 1-12 tokens in runs of one adapter (a request's rows)."""
    n_slots = draw(st.integers(1, 3))
    ids = draw(st.lists(st.integers(1, 6), min_size=n_slots, max_size=n_slots, unique=True))
    if draw(st.booleans()):
        ids[-1] = None  # a free slot
    choices = [0] + [i for i in ids if i is not None]
    runs = draw(
        st.lists(st.tuples(st.sampled_from(choices), st.integers(1, 4)), min_size=1, max_size=5)
    )
    token_ids = tuple(i for lora_id, n in runs for i in [lora_id] * n)
    return token_ids, tuple(ids)


@pytest.mark.upstream
@pytest.mark.points(5)
@CASES
@given(batch=batches(), seed=st.integers(0, 1000), scale=st.sampled_from([1.0, 0.5, 2.0]))
def test_add_lora_linear_matches_upstreams_wrapper(impl, up_punica, batch, seed, scale):
    upstream_cls, lora_mapping = up_punica
    token_ids, slot_ids = batch
    theirs = upstream_cls(64, 8, "cpu")
    theirs.update_metadata(
        lora_mapping(token_ids, token_ids, is_prefill=True),
        list(slot_ids),
        len(slot_ids) + 1,
        1000,
    )
    ours = impl.punica_cpu.PunicaWrapperCPU()
    ours.update_metadata(token_ids, slot_ids)
    g = torch.Generator().manual_seed(seed)
    slots, rank, d_in, sizes = len(slot_ids) + 1, 4, 16, (12, 6, 6)  # + the spare zero slot
    a = tuple(torch.randn(slots, 1, rank, d_in, generator=g) for _ in sizes)
    b = tuple(torch.randn(slots, 1, s, rank, generator=g) for s in sizes)
    for t in a + b:
        t[-1] = 0
    x = torch.randn(len(token_ids), d_in, generator=g)
    y = torch.randn(len(token_ids), sum(sizes), generator=g)
    y_ours, y_theirs = y.clone(), y.clone()
    written(ours.add_lora_linear, y_ours, x, a, b, scale, sizes)
    theirs.add_lora_linear(y_theirs, x, a, b, scale, sizes)
    close = torch.isclose(y_ours, y_theirs, rtol=1.3e-6, atol=1e-5)
    bad = [i for i in range(len(token_ids)) if not bool(close[i].all())]
    assert not bad, (
        f"add_lora_linear: rows {bad} differ from upstream's PunicaWrapperCPU (adapter ids per "
        f"row {token_ids}, slots {slot_ids}, shards {sizes}, scale {scale}). Row {bad[0]}: "
        f"upstream {y_theirs[bad[0]][:6].tolist()}..., yours {y_ours[bad[0]][:6].tolist()}... "
        "Each shard: (x @ lora_a[slot].T) * scale into a float32 buffer, then @ lora_b[slot].T "
        "added into its own columns of y (shard i starts after the sizes before it)."
    )


@pytest.mark.upstream
@pytest.mark.points(2)
def test_forward_is_the_base_output_plus_each_rows_adapter(impl, up_punica):
    upstream_cls, lora_mapping = up_punica
    token_ids, slot_ids, sizes, d_in = (1, 1, 0, 2, 2, 2), (1, 2), (8, 4), 10
    layer = impl.layers.BaseLinearLayerWithLoRA(_base(d_in, sizes))
    layer.create_lora_weights(2, 4, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    for slot in range(2):
        a = [torch.randn(4, d_in, generator=g) for _ in sizes]
        b = [torch.randn(s, 4, generator=g) for s in sizes]
        written(layer.set_lora, slot, a, b)
    layer.punica_wrapper = impl.punica_cpu.PunicaWrapperCPU()
    layer.punica_wrapper.update_metadata(token_ids, slot_ids)
    x = torch.randn(len(token_ids), d_in, generator=g)
    got = written(layer, x)
    theirs = upstream_cls(64, 8, "cpu")
    theirs.update_metadata(
        lora_mapping(token_ids, token_ids, is_prefill=True), list(slot_ids), 3, 1000
    )
    want = layer.base_layer(x)
    theirs.add_lora_linear(want, x, layer.lora_a_stacked, layer.lora_b_stacked, 1.0, sizes)
    torch.testing.assert_close(
        got,
        want,
        msg=lambda m: (
            "forward: the base layer's output, then the wrapper adds each row's adapter into "
            f"it (add_lora_linear, scale 1.0). Upstream's wrapper on your stacks gives another "
            f"output: {m}"
        ),
    )


@pytest.mark.phase
@pytest.mark.points(5)
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "slots",
    [{"max_loras": 2}, {"max_loras": 1, "max_cpu_loras": 1}],
    ids=["two-slots", "one-slot-one-loaded"],
)
def test_mixed_batch_equals_transformers_peft(impl, request, monkeypatch, slots):
    from mini_vllm.entrypoints.llm import LLM
    from mini_vllm.lora.request import LoRARequest
    from mini_vllm.sampling_params import SamplingParams

    every_lab_written(impl)  # before the minutes the adapters take to build
    path, ids, base, out = request.getfixturevalue("peft_adapters")
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
    scheduler_cls = plug_into_engine(impl, monkeypatch)
    llm = written(
        LLM,
        str(path),
        max_model_len=128,
        kv_cache_memory_bytes=16 << 20,
        enable_lora=True,
        max_lora_rank=8,
        scheduler_cls=scheduler_cls,
        **slots,
    )
    core = llm.llm_engine.engine_core
    assert type(core.scheduler) is scheduler_cls, "the engine must run your Scheduler"
    runner = core.model_runner
    assert type(runner.lora_manager) is impl.model_manager.LRUCacheLoRAModelManager
    assert type(runner.input_batch) is impl.gpu_input_batch.InputBatch
    params = SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)
    outs = written(
        llm.generate,
        [{"prompt_token_ids": ids[p]} for p, _ in batch],
        params,
        use_tqdm=False,
        lora_request=[r for _, r in batch],
    )
    got = [list(o.outputs[0].token_ids) for o in outs]
    wrong = [i for i in range(len(batch)) if got[i] != want[i]]
    assert not wrong, "\n".join(
        f"request {i} ({batch[i][1].lora_name if batch[i][1] else 'base model'}, prompt "
        f"{batch[i][0]!r}): transformers + peft {want[i]}, yours {got[i]}"
        for i in wrong
    ) + (
        f"\n{slots}. A request on the base model that drifts: a row without an adapter read "
        "some adapter's slot. Every request of one adapter wrong: that adapter's matrices or "
        "slot. All wrong after the first step: the slot mapping of the batch's rows."
    )
