"""Lab 18.4 — a compiled step equal to eager: one Dynamo trace for every batch size.

Graded: the ``LAB 18.4`` regions of ``labs/phase_18/decorators.py``
(``_mark_dynamic_inputs``) and ``labs/phase_18/wrapper.py``
(``TorchCompileWithNoGuardsWrapper.__init__``). Your two functions are put
in the reference's place, so mini_vllm's own ``@support_torch_compile``
model classes compile through them.

Compiled with Dynamo's ``eager`` backend (the trace, its dynamic dimension
and its guards are what is graded; inductor's code generation is not yours
and takes minutes on a small CPU):

1. a toy module, one trace: its dynamic dimension is 1, and its optional
   argument is None; called with 5, 3, 9 and 2 columns it returns what its
   plain ``forward`` returns, from one graph, never traced again (Dynamo's
   counters);
2. trace once means no guard: after the trace, a Python attribute the
   forward reads changes; a trace-once module does not trace again and keeps
   running what it traced (upstream's DYNAMO_TRACE_ONCE contract, which is
   why a compiled model must not branch on such state);
3. the engine, compiled: a tiny seeded Qwen3 under continuous batching and
   chunked prefill (steps of many sizes, prefills and decodes mixed) gives
   the greedy tokens of the same engine run eagerly and of transformers,
   from one graph, with no recompile.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from mini_vllm.compilation import decorators as ref_decorators
from mini_vllm.compilation import wrapper as ref_wrapper
from mini_vllm.config import CompilationConfig, CompilationMode, VllmConfig
from mini_vllm.forward_context import get_forward_context, set_forward_context
from mini_vllm.grading.checks import written
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.testing import hf_greedy

pytestmark = pytest.mark.timeout(240)

PROMPTS = [[(7 * i + 13 * j) % 100 for j in range(3 + 5 * i)] for i in range(6)]
MAX_TOKENS = 8


@pytest.fixture
def yours(impl, monkeypatch):
    """Your two functions in the reference's place; Dynamo's state reset."""
    monkeypatch.setattr(
        ref_decorators, "_mark_dynamic_inputs", impl.decorators._mark_dynamic_inputs
    )
    monkeypatch.setattr(
        ref_wrapper.TorchCompileWithNoGuardsWrapper,
        "__init__",
        impl.wrapper.TorchCompileWithNoGuardsWrapper.__init__,
    )
    torch._dynamo.reset()
    counters.clear()
    yield impl
    torch._dynamo.reset()


def trace_once_config() -> CompilationConfig:
    config = VllmConfig(
        compilation_config=CompilationConfig(
            mode=CompilationMode.DYNAMO_TRACE_ONCE, backend="eager"
        )
    )
    return config.compilation_config


def assert_one_trace(what: str) -> None:
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 1, f"{what}: Dynamo traced {graphs} graphs; trace-once mode traces one"
    recompiles = dict(counters["recompiles"])
    assert not recompiles, (
        f"{what}: Dynamo traced again ({recompiles}): a guard failed. In trace-once mode "
        "no guard is kept, and the batch dimension is dynamic."
    )


@ref_decorators.support_torch_compile(dynamic_arg_dims={"x": 1, "bias": 0})
class Columns(torch.nn.Module):
    """x [4, n]: each column's weighted sum, plus the number of columns, an
    optional bias [n] (always None here) and a Python float."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.arange(4.0))
        self.offset = 0.0

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = (self.weight[:, None] * x).sum(0) + x.shape[1] + self.offset
        return out if bias is None else out + bias


def compiled_columns() -> Columns:
    module = Columns()
    compiling = written(ref_decorators.enable_torch_compile, module, trace_once_config())
    assert compiling == 1, "enable_torch_compile found no decorated module to compile"
    return module


@pytest.mark.points(5)
def test_one_trace_serves_every_batch_size(yours):
    module = compiled_columns()
    with set_forward_context(None):
        for n in (5, 3, 9, 2):
            x = torch.randn(4, n)
            got, expected = written(module, x), module.forward(x)
            assert torch.allclose(got, expected), (
                f"a batch of {n} columns (dimension 1) after a trace at 5: the compiled "
                f"module returned {got.tolist()}, its forward {expected.tolist()}. Was the "
                "dimension fixed into the trace?"
            )
    assert_one_trace("batches of 5, 3, 9 and 2 columns")


@pytest.mark.points(5)
def test_trace_once_keeps_no_guard(yours):
    module = compiled_columns()
    x = torch.randn(4, 6)
    with set_forward_context(None):
        traced = written(module, x)
        module.offset = 100.0  # a guard on it would fail and trace again
        again = module(x)
    assert_one_trace("a Python attribute changed after the trace")
    assert torch.equal(again, traced), (
        "the module traced again when an attribute it reads changed: trace-once mode "
        "runs the first trace whatever the guards would have said"
    )


def _record_steps(llm) -> list[tuple[int, list[int]]]:
    """(tokens, query lengths) of every compiled step, seen by the first attention layer."""
    layer = llm.llm_engine.model.attention_layers()[0]
    seen: list[tuple[int, list[int]]] = []
    original = layer.forward

    def spy(query, key, value):
        if not torch.compiler.is_compiling():
            qsl = get_forward_context().attn_metadata.query_start_loc.tolist()
            seen.append((query.shape[0], [b - a for a, b in zip(qsl[:-1], qsl[1:], strict=True)]))
        return original(query, key, value)

    layer.forward = spy
    return seen


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> str:
    from mini_vllm.model_executor.model_loader.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_lab184"), arch="qwen3", seed=0))


def greedy(llm) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = written(
        llm.generate, [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False
    )
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.points(10)
def test_compiled_engine_equals_eager_and_transformers(yours, tiny_qwen3):
    from transformers import AutoModelForCausalLM

    from mini_vllm.entrypoints.llm import LLM

    limits = dict(
        max_model_len=128, kv_cache_memory_bytes=8 << 20, max_num_seqs=4, max_num_batched_tokens=24
    )
    llm = written(LLM, tiny_qwen3, compilation_config={"mode": 3, "backend": "eager"}, **limits)
    steps = _record_steps(llm)
    compiled = greedy(llm)
    sizes = sorted({n for n, _ in steps})
    assert_one_trace(f"engine steps of {sizes} tokens")
    assert len(sizes) >= 3 and any(1 in q and max(q) > 1 for _, q in steps), (
        f"the workload should run steps of several sizes with prefills and decodes mixed: {steps}"
    )
    eager = greedy(LLM(tiny_qwen3, **limits))
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    for i, (c, e) in enumerate(zip(compiled, eager, strict=True)):
        assert c == e, f"prompt {i}: compiled {c} != eager {e}"
        t = hf_greedy(hf, PROMPTS[i], MAX_TOKENS)
        assert c == t, f"prompt {i}: compiled {c} != transformers {t}"
