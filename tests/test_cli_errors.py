"""The CLI's bad inputs and faults: one line on stderr, never a traceback (issue 21).

Argument errors must come before the model loads: those tests point
``--model`` at a folder that does not exist, so an error about anything
else proves the argument was checked first. Checkpoint errors use broken
copies of the tiny seeded Llama; Ctrl-C and a closed pipe need text prompts,
so they use the tiny Llama with SmolLM2's tokenizer.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from mini_vllm.entrypoints import cli
from mini_vllm.model_executor.model_loader.tiny import make_tiny_model
from mini_vllm.worker.gpu_model_runner import GPUModelRunner


@pytest.fixture(scope="module")
def tiny_text_model(tmp_path_factory):
    """The tiny Llama with SmolLM2's tokenizer (takes text; says noise)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_text"), arch="llama", tokenizer=True)


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    """(exit code, stderr) of the CLI run in this process; argparse's exits included."""
    try:
        code = cli.main([*argv, "--no-progress"])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def last_line(err: str) -> str:
    lines = err.strip().splitlines()
    return lines[-1] if lines else ""


NOT_LOADED = ("--model", "/nonexistent/model")

BAD_ARGUMENTS = [
    (["--temperature", "nan"], "mini-vllm: error: --temperature must be a finite number, got nan."),
    (["--temperature", "-1"], "mini-vllm: error: --temperature must be non-negative, got -1.0."),
    (["--top-p", "0"], "mini-vllm: error: --top-p must be in (0, 1], got 0.0."),
    (["--max-tokens", "0"], "mini-vllm: error: --max-tokens must be at least 1, got 0."),
    (["--seed", str(2**64)], "mini-vllm: error: --seed must be in [-9223372036854775808, "),
    (["--chat", ""], "mini-vllm: error: --chat needs a message, got an empty one."),
    (["--chat", "   "], "mini-vllm: error: --chat needs a message, got an empty one."),
    (["--prompt", ""], "mini-vllm: error: --prompt cannot be empty."),
    (["--device", "bogus"], "mini-vllm: error: device must be auto, cpu or cuda, got 'bogus'."),
    (["--dtype", "float64"], "mini-vllm: error: dtype must be auto, float32, float16, bfloat16, "),
    # argparse's own errors (usage, then one error line), exit code 2 as well:
    (["--max-tokens", "2.5"], "mini-vllm: error: argument --max-tokens: invalid int value: '2.5'"),
    (
        ["--chat", "hi", "--prompt", "x"],
        "mini-vllm: error: argument --prompt: not allowed with argument --chat",
    ),
]


@pytest.mark.parametrize(
    ("argv", "message"), BAD_ARGUMENTS, ids=[" ".join(a) for a, _ in BAD_ARGUMENTS]
)
def test_bad_argument_is_one_line_before_the_model_loads(capsys, argv, message):
    code, err = run_cli(capsys, *NOT_LOADED, *argv)
    assert code == 2
    assert last_line(err).startswith(message), err
    assert "loaded" not in err and "/nonexistent/model" not in err


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), arch="llama")


def test_malformed_config_json_is_one_line(capsys, tiny_llama, tmp_path):
    broken = shutil.copytree(tiny_llama, tmp_path / "model")
    (broken / "config.json").write_text('{"architectures": ["Llama')
    code, err = run_cli(capsys, "--model", str(broken), "--prompt", "hi")
    assert code == 2
    assert last_line(err).startswith("mini-vllm: error: ") and "not a valid JSON file" in err


def test_truncated_safetensors_is_one_line(capsys, tiny_llama, tmp_path):
    broken = shutil.copytree(tiny_llama, tmp_path / "model")
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    code, err = run_cli(capsys, "--model", str(broken), "--prompt", "hi")
    assert code == 2
    assert last_line(err).startswith(f"mini-vllm: error: {broken}: ")
    assert "incomplete metadata" in err


def test_ctrl_c_exits_130_with_one_line(capsys, monkeypatch, tiny_text_model):
    """Ctrl-C raises KeyboardInterrupt wherever Python is; here it comes from
    inside a step, the likeliest place during a run."""

    def interrupted(self, scheduler_output, *args):
        raise KeyboardInterrupt

    monkeypatch.setattr(GPUModelRunner, "execute_model", interrupted)
    argv = ["--model", str(tiny_text_model), "--prompt", "hi", "--max-model-len", "64"]
    code, err = run_cli(capsys, *argv)
    assert code == 130
    assert last_line(err) == "mini-vllm: interrupted"


def test_output_into_a_closed_pipe_exits_141_with_one_line(tiny_text_model):
    """``mini-vllm ... | head``: the reader is gone before the output is written.
    A real pipe in a real process, because Python also flushes stdout at exit."""
    cmd = [sys.executable, "-m", "mini_vllm", "--model", str(tiny_text_model)]
    cmd += ["--prompt", "hi", "--max-tokens", "2", "--max-model-len", "64", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # nobody will ever read
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 141, err
    assert last_line(err) == "mini-vllm: output closed early (broken pipe)"
    assert "Traceback" not in err and "Exception ignored" not in err
