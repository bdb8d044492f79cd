"""CUDA graphs in the model runner (mini_vllm/compilation/cuda_graph.py, the
runner's ``capture_model``).

On CPU: no graph is captured, whatever the config says, and the wrapper runs
the model as it is outside a FULL step. What a replay computes is checked on
CPU too: a stand-in for the wrapper runs, at each FULL decode step, the model
eagerly on exactly what a graph would see (the padded token count and the
metadata the runner captures with, over the step's buffers), with the
Triton backend interpreted; the tokens must equal an eager engine's. The
``gpu`` class runs SmolLM2 on
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
from mini_vllm.forward_context import BatchDescriptor, get_forward_context, set_forward_context
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


class EmulatedReplay:
    """Runs, in a FULL step, the forward a decode graph replays: the model on
    the padded batch under the metadata the runner captures with."""

    def __init__(self, runner):
        self.runnable, self.runner = runner.model, runner
        self.replayed_sizes: list[tuple[int, int]] = []  # (real tokens, padded)

    def __getattr__(self, key):
        return getattr(self.runnable, key)

    def __call__(self, input_ids, positions, **kwargs):
        context = get_forward_context()
        if context.cudagraph_runtime_mode != CUDAGraphMode.FULL:
            return self.runnable(input_ids, positions, **kwargs)
        key = context.batch_descriptor
        real = context.attn_metadata.num_actual_tokens
        self.replayed_sizes.append((real, key.num_tokens))
        with set_forward_context(self.runner._padded_decode_metadata(key)):
            return self.runnable(input_ids, positions, **kwargs)


def test_padded_decode_steps_give_eager_tokens(tmp_path):
    path = make_tiny_model(tmp_path / "tiny", arch="llama", seed=0)
    prompts = [{"prompt_token_ids": list(range(5 + 3 * i, 12 + 5 * i))} for i in range(3)]

    def engine():
        return LLM(
            str(path),
            device="cpu",
            attention_backend="triton",
            max_model_len=64,
            kv_cache_memory_bytes=4 << 20,
            block_size=8,
            max_num_seqs=4,
        )

    eager = engine()
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, greedy(6), use_tqdm=False)]
    llm = engine()
    runner = llm.llm_engine.engine_core.model_runner
    runner.cudagraph_dispatcher.initialize_cudagraph_keys(CUDAGraphMode.FULL_DECODE_ONLY)
    runner.model = emulated = EmulatedReplay(runner)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(6), use_tqdm=False)]
    assert got == want
    # Three requests decoding together ran as the graph of 4 (one padding row).
    assert (3, 4) in emulated.replayed_sizes, emulated.replayed_sizes


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
