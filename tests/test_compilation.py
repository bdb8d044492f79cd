"""torch.compile of the model (Phase 18): the config's rules, one trace for
every batch size, and greedy tokens equal to eager's and transformers'.

The fast tier compiles with Dynamo's ``eager`` backend (the trace, the
dynamic batch dimension, the dropped guards and the opaque attention op all
run; inductor does not generate code), since an inductor compile of even
the tiny model takes a minute on a busy 2-core machine. The deep tier runs
inductor, on the tiny Qwen3 and on SmolLM2, and its on-disk cache.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from hf_reference import hf_greedy
from torch._dynamo.utils import counters

from mini_vllm.compilation.decorators import enable_torch_compile, support_torch_compile
from mini_vllm.config import (
    CompilationConfig,
    CompilationMode,
    LoRAConfig,
    ModelConfig,
    VllmConfig,
)
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.forward_context import set_forward_context
from mini_vllm.model_executor.layers.linear import LinearBase
from mini_vllm.sampling_params import SamplingParams

# Prompts of varied lengths: with a 24-token budget and 4 sequences, the steps
# mix prefill chunks and decodes at many different token counts.
PROMPTS = [[(7 * i + 13 * j) % 100 for j in range(3 + 5 * i)] for i in range(6)]


# ---------------------------------------------------------------- the config


def test_vllm_compile_becomes_one_trace_with_inductor_as_on_upstream_cpu():
    config = VllmConfig(compilation_config=CompilationConfig(mode=CompilationMode.VLLM_COMPILE))
    cc = config.compilation_config
    assert cc.mode == CompilationMode.DYNAMO_TRACE_ONCE
    assert cc.backend == "inductor"
    assert cc.inductor_compile_config["epilogue_fusion"] is True


def test_default_is_eager():
    assert VllmConfig().compilation_config.mode == CompilationMode.NONE


def test_enforce_eager_turns_compilation_off():
    config = VllmConfig(
        model_config=ModelConfig(enforce_eager=True),
        compilation_config=CompilationConfig(mode=CompilationMode.VLLM_COMPILE),
    )
    assert config.compilation_config.mode == CompilationMode.NONE


def test_lora_turns_compilation_off_as_upstream_cpu():
    config = VllmConfig(
        lora_config=LoRAConfig(),
        compilation_config=CompilationConfig(mode=CompilationMode.DYNAMO_TRACE_ONCE),
    )
    assert config.compilation_config.mode == CompilationMode.NONE


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"mode": 1}, "STOCK_TORCH_COMPILE is not supported"),
        ({"mode": 7}, "compilation mode must be"),
        ({"mode": 2, "backend": "tvm"}, "compilation backend must be"),
    ],
)
def test_unsupported_compilation_is_one_clear_line(fields, words):
    with pytest.raises(ValueError, match=words) as info:
        VllmConfig(compilation_config=CompilationConfig(**fields))
    assert "\n" not in str(info.value)


# ------------------------------------------------------- the decorator alone


@support_torch_compile(dynamic_arg_dims={"x": 0})
class _Scale(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.arange(4.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.weight).sum(-1) + x.shape[0]


def test_one_trace_serves_every_batch_size():
    module = _Scale()
    config = VllmConfig(
        compilation_config=CompilationConfig(
            mode=CompilationMode.DYNAMO_TRACE_ONCE, backend="eager"
        )
    )
    assert enable_torch_compile(module, config.compilation_config) == 1
    torch._dynamo.reset()
    counters.clear()
    with set_forward_context(None):
        for n in (5, 3, 9, 2):
            x = torch.randn(n, 4)
            assert torch.equal(module(x), module.forward(x)), f"batch of {n}"
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["recompiles"]


# ------------------------------------------------------- the engine, compiled


def _generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def _llm(path: str, **kwargs) -> LLM:
    return LLM(
        path,
        max_model_len=128,
        kv_cache_memory_bytes=8 << 20,
        max_num_seqs=4,
        max_num_batched_tokens=24,
        **kwargs,
    )


def _record_batches(llm: LLM) -> list[tuple[int, list[int]]]:
    """Spy on the first attention layer: (tokens, query lengths) of each call."""
    from mini_vllm.forward_context import get_forward_context

    layer = llm.llm_engine.model.attention_layers()[0]
    seen: list[tuple[int, list[int]]] = []
    original = layer.forward

    def spy(query, key, value):
        if torch.compiler.is_compiling():  # the trace: the op calls spy at run time
            return original(query, key, value)
        qsl = get_forward_context().attn_metadata.query_start_loc.tolist()
        seen.append((query.shape[0], [b - a for a, b in zip(qsl[:-1], qsl[1:], strict=True)]))
        return original(query, key, value)

    layer.forward = spy
    return seen


def test_compiled_engine_equals_eager_and_transformers_without_recompiles(tiny_qwen3):
    path, hf = tiny_qwen3
    eager = _generate(_llm(path))
    torch._dynamo.reset()
    counters.clear()
    llm = _llm(path, compilation_config={"mode": 3, "backend": "eager"})
    batches = _record_batches(llm)
    compiled = _generate(llm)
    assert compiled == eager
    assert compiled == [hf_greedy(hf, p, 8) for p in PROMPTS]
    # One trace, never traced again, though the batch changed size every step.
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["recompiles"]
    sizes = {n for n, _ in batches}
    assert len(sizes) >= 3, sizes
    assert any(1 in lens and max(lens) > 1 for _, lens in batches), "no prefill+decode step"


def test_the_compiled_graph_calls_the_packed_onednn_matmul(tiny_qwen3, monkeypatch):
    """Every linear in the traced model is one opaque call of ``mini_vllm::onednn_mm``
    over the weight packed at load (upstream's ``onednn_mm`` op), none a plain
    matmul, so inductor keeps the packed GEMM and fuses only what is around it."""
    path, _ = tiny_qwen3
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    real_compile = torch.compile
    monkeypatch.setattr(
        torch, "compile", lambda fn, **kw: real_compile(fn, **{**kw, "backend": recording_backend})
    )
    torch._dynamo.reset()
    llm = _llm(path, compilation_config={"mode": 3, "backend": "eager"})
    _generate(llm)
    assert len(graphs) == 1
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    model = llm.llm_engine.engine_core.model_runner.model
    linears = [m for m in model.model.modules() if isinstance(m, LinearBase)]
    assert targets.count("mini_vllm.onednn_mm.default") == len(linears) > 0, targets
    assert not [t for t in targets if "linear" in t or t.endswith(("mm", "matmul"))], targets


def test_enforce_eager_really_runs_eagerly(tiny_qwen3):
    path, _ = tiny_qwen3
    torch._dynamo.reset()
    counters.clear()
    llm = _llm(path, enforce_eager=True, compilation_config={"mode": 3})
    assert llm.llm_engine.vllm_config.compilation_config.mode == CompilationMode.NONE
    _generate(llm)
    assert not counters["stats"], "Dynamo traced something with enforce_eager=True"


# ------------------------------------------------- deep: inductor and its cache

_COLD_WARM = textwrap.dedent(
    """
    import sys, time
    from torch._dynamo.utils import counters
    from mini_vllm.entrypoints.llm import LLM
    from mini_vllm.sampling_params import SamplingParams
    path, cache = sys.argv[1], sys.argv[2]
    llm = LLM(path, max_model_len=128, kv_cache_memory_bytes=8 << 20, max_num_seqs=4,
              max_num_batched_tokens=24,
              compilation_config={"mode": 3, "cache_dir": cache})
    prompts = [[(7 * i + 13 * j) % 100 for j in range(3 + 5 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    print([o.outputs[0].token_ids for o in outs])
    print(dict(counters["inductor"]))
    """
)


@pytest.mark.deep
def test_inductor_compiled_engine_equals_transformers_and_reuses_its_cache(tiny_qwen3, tmp_path):
    """Two engine starts in fresh processes with one cache_dir: the first
    compiles (an FX-graph cache miss), the second finds the compiled graph."""
    path, hf = tiny_qwen3
    expected = [hf_greedy(hf, p, 8) for p in PROMPTS]
    runs = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", _COLD_WARM, path, str(tmp_path / "cache")],
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        tokens, stats = done.stdout.strip().splitlines()[-2:]
        assert eval(tokens) == expected
        runs.append(eval(stats))
    assert runs[0].get("fxgraph_cache_miss") == 1, runs[0]
    assert runs[1].get("fxgraph_cache_hit") == 1, runs[1]


@pytest.mark.deep
def test_smollm2_compiled_with_inductor_equals_transformers(smollm2_hf):
    path, hf = smollm2_hf
    from test_engine import _token_prompts, run_and_compare

    llm = LLM(
        str(path),
        max_model_len=256,
        kv_cache_memory_bytes=32 << 20,
        compilation_config={"mode": 3},
    )
    run_and_compare(llm, hf, _token_prompts(llm))
