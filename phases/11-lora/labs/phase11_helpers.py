"""Helpers shared by Phase 11's graded suites: your scheduler in lockstep with
upstream's, generated shrink/expand cases, both adapter managers driven by the
same operations, and the engine with your Phase 11 pieces plugged in.

(Imported by name from the suites: this folder is on sys.path because pytest
puts the folder of ``conftest.py`` there.)
"""

from __future__ import annotations

import functools
import types

import pytest
import torch
from hypothesis import strategies as st

import mini_vllm.testing as mini
from mini_vllm.grading.checks import crash_message, written
from mini_vllm.oracle.batch_workload import MiniSide
from mini_vllm.oracle.strategies import lora_workloads
from mini_vllm.oracle.workload import Stalled, lockstep_difference, run_workload

# ------------------------------------------------------------------ Lab 11.1


def scheduler_difference(impl, up, workload, expected: dict | None = None) -> str | None:
    """None if your Scheduler and upstream's agree at every step of
    ``workload`` (``expected``: upstream's trace, if already run), else the
    first step, request and field that differ."""
    expected = expected or run_workload(up, workload)
    try:
        mine = mini.create_scheduler(scheduler_cls=impl.scheduler.Scheduler, **workload.config)
        got = written(run_workload, mini, workload, scheduler=mine)
    except Stalled as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - a bug in the code under grade, told in words
        return crash_message(e)
    return lockstep_difference(expected, got)


@st.composite
def crowded_lora_workloads(draw):
    """A ``lora_workloads`` workload (mini_vllm/oracle/strategies.py) whose
    first requests arrive together on one or two more distinct adapters than
    ``max_loras`` (short requests added if it has too few), so that the limit
    holds some back in the first steps; the rest keep their drawn adapters."""
    from mini_vllm.oracle.workload import RequestSpec

    w = draw(lora_workloads())
    crowd = w.config["max_loras"] + draw(st.integers(1, 2), label="adapters over the limit")
    for i in range(len(w.requests), crowd):
        w.requests.append(RequestSpec(f"extra-{i}", [i + 1, i + 2, i + 3], max_tokens=4))
    for i, spec in enumerate(w.requests[:crowd]):
        spec.lora_id, spec.arrive_step, spec.abort_step = i + 1, 0, None
    return w


def describe(workload) -> str:
    requests = [
        (s.req_id, s.arrive_step, len(s.prompt_token_ids), s.max_tokens, s.lora_id)
        for s in workload.requests
    ]
    return (
        f"config: {workload.config}\nrequests (id, arrival step, prompt length, max_tokens, "
        f"adapter id or None): {requests}"
    )


# ------------------------------------------------------------------ Lab 11.2


@st.composite
def op_cases(draw):
    """Inputs for the six ops: stacked weights of 1-5 slots (3-D, or 4-D with
    upstream's size-1 axis), ranks 1-16, segments of 1-6 rows, each segment's
    slot drawn from -1 (a row without an adapter: the last slot) to slots - 1,
    the last slot zero or not, weights in float32 or bfloat16, and an output
    wider than the adapter's (padding) or not."""
    slots = draw(st.integers(1, 5), label="slots")
    rank = draw(st.sampled_from([1, 2, 4, 8, 16]), label="rank")
    d_in = draw(st.integers(1, 40), label="in features")
    d_out = draw(st.integers(1, 40), label="out features")
    lengths = draw(st.lists(st.integers(1, 6), min_size=1, max_size=6), label="segment lengths")
    seg_slots = draw(
        st.lists(st.integers(-1, slots - 1), min_size=len(lengths), max_size=len(lengths)),
        label="segment slots",
    )
    seed = draw(st.integers(0, 2**16), label="seed")
    g = torch.Generator().manual_seed(seed)
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]), label="weight dtype")
    a = torch.randn(slots, rank, d_in, generator=g)
    b = torch.randn(slots, d_out, rank, generator=g)
    if draw(st.booleans(), label="last slot zero"):
        a[-1], b[-1] = 0, 0
    if draw(st.booleans(), label="4-D stacks"):
        a, b = a.unsqueeze(1), b.unsqueeze(1)
    lengths_t = torch.tensor(lengths)
    starts = torch.zeros_like(lengths_t)
    starts[1:] = torch.cumsum(lengths_t, 0)[:-1]
    tokens = sum(lengths)
    pad = draw(st.integers(0, 6), label="output padding")
    offset = draw(st.integers(0, 6), label="slice offset")
    return types.SimpleNamespace(
        a=a.to(dtype),
        b=b.to(dtype),
        x=torch.randn(tokens, d_in, generator=g),
        h=torch.randn(tokens, rank, generator=g),
        y=torch.randn(tokens, d_out + pad, generator=g),
        y_slice=torch.randn(tokens, offset + d_out + pad, generator=g),
        offset=offset,
        d_out=d_out,
        scale=draw(st.sampled_from([1.0, 0.5, 2.0, 0.125]), label="scale"),
        rows=torch.repeat_interleave(torch.tensor(seg_slots), lengths_t),
        meta=(starts, lengths_t, torch.tensor(seg_slots), len(lengths), max(lengths), tokens),
        shapes=(
            f"{slots} slots, rank {rank}, in {d_in}, out {d_out}, segments {lengths} with "
            f"slots {seg_slots}, {tuple(a.shape)} stacks in {dtype}, output padding {pad}"
        ),
    )


def rows_differing(ours: torch.Tensor, theirs: torch.Tensor) -> list[int]:
    close = torch.isclose(ours, theirs, rtol=1.3e-6, atol=1e-5, equal_nan=True)
    return [i for i in range(ours.shape[0]) if not bool(close[i].all())]


def assert_same(name: str, ours: torch.Tensor, theirs: torch.Tensor, case, what: str) -> None:
    bad = rows_differing(ours, theirs)
    if bad:
        i = bad[0]
        pytest.fail(
            f"{name}: rows {bad[:8]} differ from upstream's torch op "
            f"(vllm/lora/ops/torch_ops/lora_ops.py) ({what}).\nrow {i} (slot "
            f"{int(case.rows[i])}): upstream {theirs[i][:8].tolist()}..., yours "
            f"{ours[i][:8].tolist()}...\ncase: {case.shapes}",
            pytrace=False,
        )


# ------------------------------------------------------------------ Lab 11.3


def batch_side(impl):
    """The batch lockstep's mini side with your ``InputBatch``."""
    return functools.partial(MiniSide, input_batch_cls=impl.gpu_input_batch.InputBatch)


class _Linear(torch.nn.Linear):
    """A bare linear layer with the attributes the LoRA layer reads."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out, bias=False)
        self.input_size, self.output_sizes = d_in, (d_out,)


def tiny_model(d_in: int = 6, d_out: int = 5) -> torch.nn.Module:
    """One adaptable layer, ``layer.q_proj``."""
    model = torch.nn.Module()
    model.layer = torch.nn.Module()
    model.layer.q_proj = _Linear(d_in, d_out)
    return model


def your_manager(impl, max_loras: int, max_cpu_loras: int, model=None):
    from mini_vllm.config import LoRAConfig

    config = LoRAConfig(max_lora_rank=8, max_loras=max_loras, max_cpu_loras=max_cpu_loras)
    cls = impl.model_manager.LRUCacheLoRAModelManager
    return cls(model or torch.nn.Module(), config, torch.float32, torch.device("cpu"))


def upstream_manager(max_loras: int, max_cpu_loras: int):
    """Upstream's ``LRUCacheLoRAModelManager`` (vllm/lora/model_manager.py:1163)
    with no adaptable modules: its two LRU caches and its slot table, built as
    its constructor builds them, without a model. The weight preparation
    ``_add_adapter`` runs before caching an adapter (packing, pinning) is
    skipped: these adapters have no weights."""
    from vllm.lora.model_manager import LoRALRUCache, LRUCacheLoRAModelManager

    m = LRUCacheLoRAModelManager.__new__(LRUCacheLoRAModelManager)
    m.lora_config = types.SimpleNamespace(max_loras=max_loras, max_cpu_loras=max_cpu_loras)
    m.lora_index_to_id = [None] * max_loras
    m.modules, m.packed_modules, m.is_pooling_model = {}, {}, False
    m._registered_adapters = LoRALRUCache(max_cpu_loras, m.deactivate_adapter)
    m._active_adapters = LoRALRUCache(max_loras, m._deactivate_adapter)
    m._create_merged_loras_inplace = lambda lora: None
    return m


def manager_state(m, upstream: bool) -> dict:
    """Slot table and both LRU orders (least recently used first)."""
    if upstream:
        registered = list(m._registered_adapters.order)
        active = list(m._active_adapters.order)
    else:
        registered, active = list(m._registered_adapters), list(m._active_adapters)
    return {
        "lora_index_to_id (slot -> adapter id)": list(m.lora_index_to_id),
        "loaded adapters (_registered_adapters, least recently used first)": registered,
        "adapters in slots (_active_adapters, least recently used first)": active,
    }


@st.composite
def manager_ops(draw):
    """(max_loras, max_cpu_loras, operations): 1-3 slots, up to 3 more adapters
    kept loaded than slots, and 1-25 operations on adapter ids 1-6."""
    max_loras = draw(st.integers(1, 3), label="max_loras")
    max_cpu = draw(st.integers(max_loras, max_loras + 3), label="max_cpu_loras")
    kinds = ["add", "add", "activate", "activate", "activate", "deactivate", "remove"]
    ops = draw(
        st.lists(st.tuples(st.sampled_from(kinds), st.integers(1, 6)), min_size=1, max_size=25),
        label="operations",
    )
    return max_loras, max_cpu, ops


def apply_op(m, op: tuple[str, int], upstream: bool):
    """One operation; activating an adapter that is not loaded loads it first
    (as the worker does: upstream refuses to activate what it has not loaded)."""
    from mini_vllm.lora.lora_model import LoRAModel

    kind, lora_id = op
    lora = types.SimpleNamespace(id=lora_id) if upstream else LoRAModel(lora_id, 1, {})
    if kind == "add":
        return m.add_adapter(lora)
    if kind == "activate":
        if lora_id not in m.list_adapters():
            m.add_adapter(lora)
        return m.activate_adapter(lora_id)
    if kind == "deactivate":
        return m.deactivate_adapter(lora_id)
    return m.remove_adapter(lora_id)


# ------------------------------------------------------------------ Lab 11.4


def every_lab_written(impl) -> None:
    """Reach one region of each Phase 11 lab on tiny inputs, so that an
    unwritten one fails the test at once (before SmolLM2 and the adapters
    are built, which takes minutes)."""
    from mini_vllm.oracle.batch_workload import MiniSide

    sched = mini.create_scheduler(scheduler_cls=impl.scheduler.Scheduler, max_loras=1)
    written(sched.schedule)  # 11.1: the running requests' adapters
    x, a = torch.ones(2, 3), torch.ones(2, 1, 4, 3)
    written(impl.lora_ops.bgmv_shrink, x, a, torch.zeros(2, 4), torch.tensor([0, -1]))  # 11.2
    side = MiniSide(
        {"block_size": 4, "max_model_len": 16, "max_num_reqs": 2, "max_num_batched_tokens": 16},
        input_batch_cls=impl.gpu_input_batch.InputBatch,
    )
    params = {"temperature": 0.0, "stop_token_ids": [], "lora_id": 1}
    written(side.batch.add_request, side.new_state("r", [1, 2], params, None, [], 0))  # 11.3
    layer = impl.layers.BaseLinearLayerWithLoRA(_Linear(3, 2))
    layer.create_lora_weights(1, 4, torch.float32, torch.device("cpu"))
    written(layer.set_lora, 0, [torch.ones(4, 3)], [torch.ones(2, 4)])  # 11.4


def plug_into_engine(impl, monkeypatch) -> type:
    """Make the engine run your Phase 11 pieces; returns your Scheduler class,
    for ``LLM(scheduler_cls=...)``. The runner builds your ``InputBatch`` and
    your ``LRUCacheLoRAModelManager``; the manager wraps the model's layers in
    your ``BaseLinearLayerWithLoRA`` and gives them your ``PunicaWrapperCPU``,
    whose shrink and expand are your ops."""
    from mini_vllm.lora import model_manager
    from mini_vllm.worker import gpu_model_runner

    monkeypatch.setattr(gpu_model_runner, "InputBatch", impl.gpu_input_batch.InputBatch)
    monkeypatch.setattr(
        gpu_model_runner, "LRUCacheLoRAModelManager", impl.model_manager.LRUCacheLoRAModelManager
    )
    monkeypatch.setattr(
        model_manager, "BaseLinearLayerWithLoRA", impl.layers.BaseLinearLayerWithLoRA
    )
    monkeypatch.setattr(model_manager, "PunicaWrapperCPU", impl.punica_cpu.PunicaWrapperCPU)
    return impl.scheduler.Scheduler


# The real run's prompts and adapters (lab-04-mixed-real-run/conftest.py builds them).
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Hi"]
N_TOKENS = 6
ADAPTERS = {
    # name: (seed, peft.LoraConfig keywords), as tests/test_lora_engine.py
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


def randomize_lora(model, seed: int) -> None:
    """Seeded adapter weights large enough to change the greedy tokens."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.05)
