"""LLM's remaining promises: a pluggable scheduler, chat, start-up checks, the CLI."""

from __future__ import annotations

import pytest

from mini_vllm.core.sched.scheduler import Scheduler
from mini_vllm.entrypoints import cli
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.model_executor.model_loader import smollm2_gguf_path
from mini_vllm.model_executor.model_loader.tiny import make_tiny_model
from mini_vllm.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10]}]


class CountingScheduler(Scheduler):
    """The reference scheduler, counting its schedule() calls: stands in for
    a student's scheduler plugged into the real engine."""

    calls = 0

    def schedule(self):
        CountingScheduler.calls += 1
        return super().schedule()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    make_tiny_model(folder, arch="qwen3", seed=0)
    return str(folder)


@pytest.mark.parametrize("how", ["class", "dotted path"])
def test_scheduler_cls_plugs_a_scheduler_into_the_engine(tiny, how):
    CountingScheduler.calls = 0
    plugged = CountingScheduler if how == "class" else f"{__name__}.CountingScheduler"
    ref = LLM(tiny, max_model_len=64, kv_cache_memory_bytes=8 << 20)
    llm = LLM(tiny, max_model_len=64, kv_cache_memory_bytes=8 << 20, scheduler_cls=plugged)
    assert type(llm.llm_engine.engine_core.scheduler) is CountingScheduler
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == want and CountingScheduler.calls >= 6


def test_bad_scheduler_cls_path_is_a_clear_error(tiny):
    with pytest.raises(ValueError, match="Cannot import scheduler_cls"):
        LLM(tiny, max_model_len=64, kv_cache_memory_bytes=8 << 20, scheduler_cls="no.such.Class")


def test_kv_budget_too_small_fails_at_start_up_with_the_numbers(tiny):
    with pytest.raises(ValueError) as err:
        LLM(tiny, max_model_len=64, block_size=16, kv_cache_memory_bytes=50_000)
    msg = str(err.value)
    assert "KV cache too small" in msg and "kv_cache_memory_bytes=50000" in msg
    assert "needs 5 blocks" in msg  # 64 / 16 = 4 blocks, plus the null block


def test_chat_uses_the_model_template():
    llm = LLM(str(smollm2_gguf_path()), max_model_len=256, kv_cache_memory_bytes=16 << 20)
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    (out,) = llm.chat(messages, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    expected_prompt = tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert out.prompt_token_ids == list(expected_prompt)
    assert "Paris" in out.outputs[0].text


def test_cli_generates_and_reports_throughput(capsys):
    assert (
        cli.main(
            [
                "--prompt",
                "The capital of France is",
                "--max-tokens",
                "4",
                "--no-progress",
                "--max-model-len",
                "128",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert ">>> The capital of France is" in printed and "Paris" in printed
    assert "output tok/s" in printed


def test_cli_reports_a_bad_model_path_without_a_traceback(capsys, tmp_path):
    assert cli.main(["--model", str(tmp_path / "missing"), "--no-progress"]) == 2
    assert "mini-vllm: error:" in capsys.readouterr().err


def test_triton_on_cpu_after_triton_was_imported_is_a_clear_error(tiny):
    """Triton's interpreter must be switched on before triton is imported; an
    engine asked for it too late says so instead of crashing in a kernel."""
    import os
    import subprocess
    import sys

    code = (
        "import triton\n"
        "from mini_vllm.entrypoints.llm import LLM\n"
        f"LLM({tiny!r}, max_model_len=64, kv_cache_memory_bytes=8 << 20,\n"
        "    attention_backend='triton', device='cpu')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode != 0
    assert "set TRITON_INTERPRET=1" in result.stderr
