"""CUDA graphs in the model runner (mini_vllm/compilation/cuda_graph.py, the
runner's ``capture_model``).

On CPU: no graph is captured, whatever the config says, and the wrapper runs
the model as it is outside a FULL step. The ``gpu`` class runs SmolLM2 on
CUDA with the Triton backend: the decode steps replay graphs captured at
start-up, a batch of 3 padded to the graph of 4, and the greedy tokens equal
those of the same engine with ``enforce_eager=True``.
"""

from __future__ import annotations

import pytest
import torch
from hf_reference import PROMPTS

from mini_vllm.compilation.cuda_graph import CUDAGraphWrapper
from mini_vllm.config import CUDAGraphMode
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.forward_context import BatchDescriptor, set_forward_context
from mini_vllm.model_executor.model_loader import smollm2_gguf_path
from mini_vllm.model_executor.model_loader.tiny import make_tiny_model
from mini_vllm.sampling_params import SamplingParams


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_no_graphs_on_cpu(tmp_path):
    path = make_tiny_model(tmp_path / "tiny", seed=0)
    llm = LLM(str(path), max_model_len=64, kv_cache_memory_bytes=4 << 20, device="cpu")
    runner = llm.llm_engine.engine_core.model_runner
    assert runner.cudagraph_dispatcher.cudagraph_mode == CUDAGraphMode.NONE
    assert not isinstance(runner.model, CUDAGraphWrapper)
    # The config still asks for graphs (upstream's sizes): the runner declined them.
    assert llm.llm_engine.vllm_config.compilation_config.cudagraph_mode == (
        CUDAGraphMode.FULL_DECODE_ONLY
    )


def test_wrapper_runs_the_model_outside_a_full_step():
    model = torch.nn.Linear(2, 2)
    wrapper = CUDAGraphWrapper(model, CUDAGraphMode.FULL)
    x = torch.ones(1, 2)
    with set_forward_context(None, None, CUDAGraphMode.NONE, BatchDescriptor(1)):
        assert torch.equal(wrapper(x), model(x))
    assert wrapper.concrete_cudagraph_entries == {} and wrapper.num_replays == 0
    assert wrapper.weight is model.weight  # the model's attributes show through


def smollm2_on_cuda(enforce_eager: bool) -> LLM:
    return LLM(
        str(smollm2_gguf_path()),
        device="cuda",
        dtype="float32",
        attention_backend="triton",
        max_model_len=512,
        kv_cache_memory_bytes=256 << 20,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        enforce_eager=enforce_eager,
    )


@pytest.mark.gpu
class TestCudaGraphsOnCuda:
    N = 16

    def test_decode_replays_graphs_and_matches_eager(self):
        prompts = PROMPTS[:3]  # a decode batch of 3 runs the graph of 4
        eager = smollm2_on_cuda(enforce_eager=True)
        eager_runner = eager.llm_engine.engine_core.model_runner
        assert not isinstance(eager_runner.model, CUDAGraphWrapper)
        want = [o.outputs[0].token_ids for o in eager.generate(prompts, greedy(self.N))]
        del eager, eager_runner
        torch.cuda.empty_cache()

        llm = smollm2_on_cuda(enforce_eager=False)
        runner = llm.llm_engine.engine_core.model_runner
        assert isinstance(runner.model, CUDAGraphWrapper)
        # One FULL decode graph per capture size up to max_num_seqs (8).
        captured = sorted(k.num_tokens for k in runner.model.concrete_cudagraph_entries)
        assert captured == [1, 2, 4, 8]
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(self.N))]
        assert got == want
        # All but the first token of each request come from decode steps.
        assert runner.model.num_replays >= self.N - 1
        entry = runner.model.concrete_cudagraph_entries[BatchDescriptor(4, 4, True)]
        assert entry.cudagraph is not None
