"""KV connectors measured: a stored prefix hit, and a prefill/decode pair against one engine.

``python -m mini_vllm.benchmarks.kv_connector [--model PATH] [--num-requests N]
[--prompt-len L] [--output-len M] [--concurrency C] [--out DIR]``

1. **Storage (ExampleConnector).** One process. Each prompt (seeded random
   token ids, ``--prompt-len`` long) runs alone with ``max_tokens=1``, prefix
   caching off, three ways: an engine without a connector; an engine with
   ExampleConnector on an empty folder (a miss: it computes and saves every
   layer's KV); the same engine again (a hit: it loads the stored blocks and
   computes only the last partial block), the three back to back for each
   prompt. TTFT = first token time - arrival time (RequestMetrics), median
   over the prompts.
2. **Disaggregated pair (ZmqConnector).** Three server processes
   (``mini-vllm serve``, same flags): one engine alone; a prefill engine and
   a decode engine with ``--kv-transfer-config``, behind the proxy
   (mini_vllm/entrypoints/disagg_proxy.py, on a thread here). The same
   workload goes to the single engine, then through the proxy: ``--num-requests``
   prompts of 32-128 seeded random tokens, ``--output-len`` tokens each (EOS
   ignored, greedy), at most ``--concurrency`` in flight, streamed by the
   openai client (serve.py's ``run_level``: TTFT = request sent -> first text
   chunk; TPOT = (last - first chunk) / (tokens - 1); output tok/s over the
   wall time). Bytes moved = the blocks each prefill answer names
   (``remote_block_ids``, as the proxy saw them) x the bytes of one block
   (layers x K and V x block_size x KV heads x head size x 4 bytes): the KV
   payload, not counting headers.

Writes ``OUT/kv_connector.json`` and prints two markdown tables, with the
CPU count, torch threads and the 1-minute load average.

What two processes on a 2-core CPU can show: that the pair is correct (the
same tokens), what the hand-off costs (a prefill round trip, a socket copy of
the KV, the decode engine recomputing the last prompt token), and how many
bytes a token's KV is. What it cannot show is the point of the design: on a
GPU pair, prefill and decode run on separate devices, so a long prefill no
longer stalls the decode batch (steady TPOT) and each side is sized and
batched for its own phase, with the KV moving over NVLink or RDMA. Here both
engines share the same two cores, and the copy goes through the CPU and a
TCP socket, so the pair is expected to be slower than one engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")  # before torch imports tqdm
import torch  # noqa: E402

from mini_vllm.benchmarks.serve import MODEL_NAME, make_prompts, run_level  # noqa: E402
from mini_vllm.entrypoints.disagg_proxy import (  # noqa: E402
    build_app,
    server_command,
    wait_until_healthy,
)

DEFAULT_OUT = Path(__file__).parent / "results"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ storage


def storage_ttft(model: str, num_requests: int, prompt_len: int, **llm_kwargs) -> dict:
    """Median TTFT of each prompt alone: no connector, a stored-prefix miss, a hit."""
    from mini_vllm.entrypoints.llm import LLM
    from mini_vllm.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def ttft(llm, prompt) -> float:
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return out.metrics.first_token_time - out.metrics.arrival_time

    plain = LLM(model, enable_prefix_caching=False, **llm_kwargs)
    vocab = plain.llm_engine.hf_config.vocab_size
    # One block's K and V over every layer, as the paged cache holds them.
    layers = plain.llm_engine.engine_core.model_runner.model.attention_layers()
    block_bytes = sum(layer.kv_cache[0].numel() * layer.kv_cache.element_size() for layer in layers)
    rng = random.Random(1)
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(num_requests + 1)]
    warm, prompts = prompts[0], prompts[1:]
    result: dict[str, list[float]] = {"no_connector": [], "miss_and_save": [], "stored_hit": []}
    with tempfile.TemporaryDirectory(prefix="kv_connector_bench_") as folder:
        config = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": folder},
        }
        llm = LLM(model, enable_prefix_caching=False, kv_transfer_config=config, **llm_kwargs)
        ttft(plain, warm)  # one-off costs, not timed
        ttft(llm, warm)
        # The three cases of one prompt back to back, so that a change in the
        # machine's load between prompts hits all three alike.
        for prompt in prompts:
            result["no_connector"].append(ttft(plain, prompt))
            result["miss_and_save"].append(ttft(llm, prompt))
            result["stored_hit"].append(ttft(llm, prompt))
        stored = sum(len(files) for _, _, files in os.walk(folder))
    return {
        "vocab_size": vocab,
        "block_bytes": block_bytes,
        "prompt_len": prompt_len,
        "num_requests": num_requests,
        "files_stored": stored,
        "ttft_s": {k: statistics.median(v) for k, v in result.items()},
        "ttft_all_s": result,
    }


# --------------------------------------------------------------------- pair


class Servers:
    """Server processes (killed on exit) and the proxy on a thread."""

    def __init__(self, model: str, serve_args: list[str], log_dir: Path) -> None:
        self.model, self.serve_args, self.log_dir = model, serve_args, log_dir
        self.procs: list[subprocess.Popen] = []
        self.proxy = None

    def start(self, name: str, connector: bool) -> str:
        port = free_port()
        args = [self.model, "--served-model-name", MODEL_NAME, *self.serve_args]
        if connector:
            cmd = server_command(port, free_port(), *args)
        else:
            cmd = [sys.executable, "-m", "mini_vllm", "serve", "--port", str(port), *args]
        log = open(self.log_dir / f"{name}.log", "w")
        self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
        return f"http://127.0.0.1:{port}"

    def start_proxy(self, prefill: str, decode: str) -> tuple[str, dict]:
        import uvicorn

        app = build_app([prefill], [decode])
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.proxy = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        threading.Thread(target=self.proxy.run, kwargs={"sockets": [sock]}, daemon=True).start()
        while not self.proxy.started:
            time.sleep(0.05)
        return f"http://127.0.0.1:{sock.getsockname()[1]}", app.state.stats

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.should_exit = True
        for proc in self.procs:
            proc.kill()
            proc.wait()


def pair_vs_single(
    model: str,
    num_requests: int,
    output_len: int,
    concurrency: int,
    serve_args: list[str],
    vocab_size: int,
    block_bytes: int,
) -> dict:
    with tempfile.TemporaryDirectory(prefix="kv_connector_bench_logs_") as logs:
        servers = Servers(model, serve_args, Path(logs))
        try:
            single = servers.start("single", connector=False)
            prefill = servers.start("prefill", connector=True)
            decode = servers.start("decode", connector=True)
            for url, proc in zip((single, prefill, decode), servers.procs, strict=True):
                wait_until_healthy(url, proc)
            proxy, stats = servers.start_proxy(prefill, decode)
            prompts = make_prompts(num_requests, vocab_size)
            asyncio.run(run_level(single, prompts[:2], 2, 2))  # warm-up, not timed
            asyncio.run(run_level(proxy, prompts[:2], 2, 2))
            stats.update(requests=0, remote_blocks=0)
            report = {
                "single": asyncio.run(run_level(single, prompts, output_len, concurrency)),
                "pair": asyncio.run(run_level(proxy, prompts, output_len, concurrency)),
            }
        finally:
            servers.stop()
    moved = stats["remote_blocks"] * block_bytes
    pair = report["pair"]
    report["transfers"] = {
        "requests": stats["requests"],
        "blocks": stats["remote_blocks"],
        "bytes": moved,
        "bytes_per_prompt_token": moved / sum(len(p) for p in prompts),
        "bytes_per_output_token": moved / max(1, pair["tokens"]),
    }
    return report


# --------------------------------------------------------------------- main


def markdown(report: dict) -> str:
    s = report["storage"]
    t = s["ttft_s"]
    lines = [
        f"Stored prefix (ExampleConnector), {s['num_requests']} prompts of {s['prompt_len']} "
        "tokens, one at a time, max_tokens=1, prefix caching off:",
        "",
        "| case | median TTFT (ms) | of no connector |",
        "| --- | ---: | ---: |",
    ]
    for name in ("no_connector", "miss_and_save", "stored_hit"):
        lines.append(
            f"| {name.replace('_', ' ')} | {1e3 * t[name]:.0f} | "
            f"{t[name] / t['no_connector']:.2f}x |"
        )
    p = report["pair"]
    lines += [
        "",
        f"Prefill/decode pair (ZmqConnector) against one engine, {report['num_requests']} "
        f"requests, {report['output_len']} output tokens, concurrency {report['concurrency']}:",
        "",
        "| setup | output tok/s | TTFT p50 / p90 (ms) | TPOT p50 / p90 (ms) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name in ("single", "pair"):
        r = p[name]
        lines.append(
            f"| {name} | {r['output_tok_s']:.1f} | {1e3 * r['ttft_s']['p50']:.0f} / "
            f"{1e3 * r['ttft_s']['p90']:.0f} | {1e3 * r['tpot_s']['p50']:.0f} / "
            f"{1e3 * r['tpot_s']['p90']:.0f} |"
        )
    x = p["transfers"]
    lines += [
        "",
        f"KV moved: {x['blocks']} blocks, {x['bytes'] / 1e6:.1f} MB for {x['requests']} "
        f"requests: {x['bytes_per_prompt_token'] / 1e3:.1f} kB per prompt token, "
        f"{x['bytes_per_output_token'] / 1e3:.1f} kB per output token.",
        f"CPUs {report['cpus']}, torch threads {report['torch_threads']}, "
        f"load average {report['load_average_1m']:.2f} before the run.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    from mini_vllm.model_executor.model_loader import smollm2_gguf_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=384)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    model = args.model or str(smollm2_gguf_path())
    report = {
        "model": model,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_1m": os.getloadavg()[0],
        "num_requests": args.num_requests,
        "output_len": args.output_len,
        "concurrency": args.concurrency,
    }
    llm_kwargs = dict(max_model_len=512, block_size=args.block_size, kv_cache_memory_bytes=64 << 20)
    report["storage"] = storage_ttft(model, args.num_requests, args.prompt_len, **llm_kwargs)
    serve_args = ["--max-model-len", "512", "--block-size", str(args.block_size)]
    serve_args += ["--kv-cache-memory-bytes", str(64 << 20), "--no-prefix-caching"]
    serve_args += ["--max-num-seqs", str(max(4, args.concurrency))]
    storage = report["storage"]
    report["pair"] = pair_vs_single(
        model,
        args.num_requests,
        args.output_len,
        args.concurrency,
        serve_args,
        storage["vocab_size"],
        storage["block_bytes"],
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_connector.json").write_text(json.dumps(report, indent=2))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
