"""Phase 18: a trace of engine steps from the torch profiler.

``LLM.start_profile()`` / ``stop_profile()`` around a generation (upstream's
names, vllm/entrypoints/llm.py:786) write one Chrome trace under
``profiler_config``'s ``torch_profiler_dir``, named as upstream names rank 0's;
the trace holds the model's ops (its layers, their matrix multiplies, the
embedding and the sampler's argmax), and nothing is recorded outside the two
calls.
"""

from __future__ import annotations

import gzip
import json

import pytest
from serve_helpers import tiny_text_model

from mini_vllm.entrypoints.llm import LLM
from mini_vllm.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
GEMMS = {"aten::linear", "aten::addmm", "aten::mm", "aten::matmul", "mkldnn::_linear_pointwise"}


def op_names(path) -> set[str]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return {event["name"] for event in trace["traceEvents"] if "name" in event}


@pytest.mark.parametrize("use_gzip", [False, True])
def test_a_profiled_step_writes_a_trace_of_the_model_ops(tmp_path, use_gzip):
    llm = LLM(
        tiny_text_model(),
        max_model_len=64,
        profiler_config={
            "profiler": "torch",
            "torch_profiler_dir": str(tmp_path),
            "torch_profiler_use_gzip": use_gzip,
        },
    )
    llm.generate([[1, 2, 3]], PARAMS, use_tqdm=False)  # not recorded
    assert not list(tmp_path.iterdir()), "a trace before start_profile"
    llm.start_profile(profile_prefix="step")
    llm.generate([[4, 5, 6, 7]], PARAMS, use_tqdm=False)
    llm.stop_profile()
    traces = list(tmp_path.iterdir())
    assert len(traces) == 1, f"one trace per start/stop, got {traces}"
    name = traces[0].name
    assert name.startswith("step_dp0_pp0_tp0_dcp0_ep0_rank0.")
    assert name.endswith(".pt.trace.json.gz" if use_gzip else ".pt.trace.json")
    names = op_names(traces[0])
    # The model's layers (module scopes, with_stack on), their GEMM kernels
    # (aten's, or oneDNN's on a CPU that has it), the embedding and the sampler.
    layers = {n.split(": ")[1].rstrip("_0123456789") for n in names if n.startswith("nn.Module: ")}
    assert {"QKVParallelLinear", "RowParallelLinear"} <= layers, sorted(layers)
    assert names & GEMMS, "no matrix multiply in the trace"
    assert {"aten::embedding", "aten::argmax"} <= names


def test_start_profile_without_a_profiler_config_says_how(tmp_path):
    llm = LLM(tiny_text_model(), max_model_len=64)
    with pytest.raises(RuntimeError, match="Profiling is not enabled"):
        llm.start_profile()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"profiler": "torch"}, "torch_profiler_dir must be set"),
        ({"torch_profiler_dir": "/tmp/x"}, "only applicable when profiler is set to 'torch'"),
        ({"profiler": "cuda", "torch_profiler_dir": "/tmp/x"}, "profiler must be 'torch'"),
    ],
)
def test_bad_profiler_config_is_refused_before_loading(config, message):
    with pytest.raises(ValueError, match=message):
        LLM("/nonexistent/model", profiler_config=config)
