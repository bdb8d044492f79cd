"""Phase 17: the process groups and their collectives (mini_vllm/distributed/parallel_state.py).

Two gloo ranks, spawned and joined through a TCP store, run each collective
of the tensor-parallel group; what every rank gets must be what the
collective means, computed here from the ranks' inputs. Outside any run a
process is a group of one. ``ParallelConfig`` takes upstream's names and
refuses bad values in one line naming the field.
"""

from __future__ import annotations

import pytest
import torch
from tp_workers import collectives, rank_tensor, run_ranks

from mini_vllm.config import ModelConfig, ParallelConfig, VllmConfig
from mini_vllm.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    model_parallel_is_initialized,
)
from mini_vllm.utils.network_utils import get_distributed_init_method


def test_collectives_on_two_ranks():
    results = run_ranks(collectives, 2)
    inputs = [rank_tensor(r) for r in range(2)]
    for rank, got in enumerate(results):
        assert (got["rank"], got["world_size"]) == (rank, 2)
        torch.testing.assert_close(got["all_reduce"], inputs[0] + inputs[1], rtol=0, atol=0)
        torch.testing.assert_close(got["all_gather_0"], torch.cat(inputs, 0), rtol=0, atol=0)
        torch.testing.assert_close(got["all_gather_last"], torch.cat(inputs, -1), rtol=0, atol=0)
        torch.testing.assert_close(got["broadcast"], inputs[1], rtol=0, atol=0)
        assert got["broadcast_object"] == {"from": 0, "text": "hi"}
        # counted and timed: what the tensor_parallel benchmark's communication share adds up
        assert got["comm_calls"] == {"all_reduce": 1, "all_gather": 2}
        assert set(got["comm_seconds"]) == {"all_reduce", "all_gather"}
        assert all(seconds > 0 for seconds in got["comm_seconds"].values())


def test_outside_a_run_the_group_has_one_rank():
    assert not model_parallel_is_initialized()
    assert get_tensor_model_parallel_world_size() == 1
    assert get_tensor_model_parallel_rank() == 0


def test_init_method_is_a_tcp_address():
    assert get_distributed_init_method("10.0.0.2", 29500) == "tcp://10.0.0.2:29500"
    assert get_distributed_init_method("::1", 29500) == "tcp://[::1]:29500"


def test_parallel_config_resolves_and_refuses():
    assert ParallelConfig().distributed_executor_backend == "uni"
    assert ParallelConfig(tensor_parallel_size=2).distributed_executor_backend == "mp"
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        ParallelConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of"):
        ParallelConfig(distributed_executor_backend="mpi")
    with pytest.raises(ValueError, match="'uni' runs one process"):
        ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="does not support quantization"):
        VllmConfig(
            model_config=ModelConfig(quantization="int8_per_channel"),
            parallel_config=ParallelConfig(tensor_parallel_size=2),
        )


def test_cli_and_server_take_the_tensor_parallel_flags(capsys):
    import argparse

    from mini_vllm.entrypoints import cli
    from mini_vllm.entrypoints.openai.api_server import add_server_args

    # Checked before the model loads (the model path does not exist).
    code = cli.main(["--model", "/nonexistent/model", "-tp", "0", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code != 0
    assert err == "mini-vllm: error: --tensor-parallel-size must be an integer >= 1, got 0."
    args = add_server_args(argparse.ArgumentParser()).parse_args(
        ["--tensor-parallel-size", "3", "--distributed-executor-backend", "mp"]
    )
    assert (args.tensor_parallel_size, args.distributed_executor_backend) == (3, "mp")


def test_a_model_tensor_parallel_cannot_split_is_refused_before_the_workers_start():
    from transformers import LlamaConfig

    smollm2_shape = LlamaConfig(
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
    )
    model_config = ModelConfig()
    model_config.verify_with_parallel_config(smollm2_shape, ParallelConfig(3))
    with pytest.raises(ValueError, match=r"attention heads \(9\) must be divisible by tensor"):
        model_config.verify_with_parallel_config(smollm2_shape, ParallelConfig(2))
    tiny = LlamaConfig(
        hidden_size=48,
        num_attention_heads=6,
        num_key_value_heads=2,
        intermediate_size=96,
        vocab_size=512,
    )
    with pytest.raises(ValueError, match=r"KV heads \(2\) must divide"):
        model_config.verify_with_parallel_config(tiny, ParallelConfig(3))


def test_a_vision_language_model_is_refused_above_one_rank():
    """mini's LLaVA builds its vision tower unsplit, so TP > 1 is refused before
    any worker starts (without this check the engine got an AttributeError on the
    config, or a worker failed while building the model)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    llava = LlavaConfig(
        vision_config=CLIPVisionConfig(num_attention_heads=2, hidden_size=32),
        text_config=LlamaConfig(num_attention_heads=4, num_key_value_heads=2),
    )
    ModelConfig().verify_with_parallel_config(llava, ParallelConfig(1))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: .*vision-language"):
        ModelConfig().verify_with_parallel_config(llava, ParallelConfig(2))
