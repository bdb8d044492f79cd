"""``python -m mini_vllm.benchmarks.tensor_parallel`` runs, at a tiny setting.

The tiny seeded Llama at TP=1 and TP=2, two requests, a few decode steps:
the split run gives TP=1's tokens, counts the collectives a step makes (one
all-reduce for the embedding, one after o_proj and one after down_proj in
each layer, one all-gather of the logits) and their bytes, measures a
communication share from GroupCoordinator's timed collectives, and the GPU
model adds an all-reduce term only where there is something to all-reduce.
"""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig

from mini_vllm.benchmarks import tensor_parallel
from mini_vllm.model_executor.model_loader.tiny import make_tiny_model


@pytest.mark.deep  # two engines, one with two spawned workers: ~25 s on 2 busy cores
def test_the_benchmark_runs_at_a_tiny_setting(tmp_path):
    model = make_tiny_model(tmp_path / "tiny-llama", arch="llama", seed=0)
    argv = ["--model", str(model), "--tp", "1", "2", "--small-tp", "--batch", "2"]
    argv += ["--prompt-len", "16", "--output-len", "5", "--out", str(tmp_path / "out")]
    report = tensor_parallel.main(argv)
    saved = json.loads((tmp_path / "out" / "tensor_parallel_cpu.json").read_text())
    assert saved == json.loads(json.dumps(report))
    [entry] = report["models"]
    whole, split = entry["runs"]
    assert (whole["tp"], split["tp"]) == (1, 2)
    assert split["same_tokens_as_tp1"] and len(split["tokens"][0]) == 5
    assert whole["steps_timed"] == split["steps_timed"] == 5 - 2  # prefill and one untimed step
    config = AutoConfig.from_pretrained(model)
    assert split["all_reduce_per_step"] == 1 + 2 * config.num_hidden_layers
    assert split["all_gather_per_step"] == 1
    # each all-reduce sums a (batch, hidden) float32 activation
    assert (
        split["all_reduce_bytes_per_step"]
        == split["all_reduce_per_step"] * 2 * config.hidden_size * 4
    )
    assert 0 < split["comm_share_mean"] <= split["comm_share_max"] < 1
    assert split["threads_per_worker"] == [1, 1]
    assert whole["flops_per_step"] > 0 and split["ratio_to_tp1"] > 0
    gpu_whole, gpu_split = entry["gpu_model"]
    assert gpu_whole["all_reduce_us"] == 0 < gpu_split["all_reduce_us"]
    assert gpu_split["compute_us"] == pytest.approx(gpu_whole["compute_us"] / 2)
