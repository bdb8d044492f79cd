"""Greedy decoding with and without a KV cache, on mini_vllm's real model code.

    python -m mini_vllm.benchmarks.kv_cache_speedup [--lengths 64 128 256 512] [--repeats 5]

A course module (Phase 00, Lab 00.1); it has no upstream counterpart.
Upstream always decodes with its paged KV cache; this module shows why, by
running the same model both ways and counting and timing the work.

``PagedModel`` (given) runs one sequence through a model against a paged
KV cache: "feed these tokens at positions start..start+n-1 of the sequence
and return the last token's logits". It builds the attention metadata the
engine's model runner builds (``slot_mapping``, ``block_table``,
``seq_lens``, ``query_start_loc``; see attention/backend.py) and records
every position it is fed. The lab writes two greedy loops on top of it:

- ``greedy_without_cache``: every step forgets the cache and feeds the whole
  sequence again, as a prefill. Step t feeds P + t tokens (P = prompt
  length), so n tokens cost P*n + n(n-1)/2 token-forwards: quadratic.
- ``greedy_with_cache``: one prefill of the prompt, then each step feeds
  only the newest token; the keys and values of the earlier positions are
  already in the cache and do not change. n tokens cost P + n - 1
  token-forwards: linear.

Both must produce the same tokens (transformers' greedy tokens, checked by
the lab's tests). The benchmark times one decode step at growing context
lengths both ways on SmolLM2-135M (medians of ``--repeats``), and whole
generations (medians of 3, the two loops alternating), and writes
``results/kv_cache_speedup_<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

from mini_vllm.attention.backend import AttentionMetadata
from mini_vllm.forward_context import set_forward_context
from mini_vllm.kv_cache_interface import cdiv
from mini_vllm.worker.gpu_worker import allocate_kv_caches

RESULTS = Path(__file__).parent / "results"


class PagedModel:
    """One sequence of up to ``max_model_len`` tokens, one model, one paged KV cache.

    Given code (not a lab). The sequence owns blocks 1..N of the cache
    (block 0 is the null block, as in the engine). ``forward`` may only
    feed positions whose earlier positions are cached: it raises otherwise,
    because attention would read keys and values that were never written.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        max_model_len: int,
        block_size: int = 16,
        attention_backend: str = "torch",
    ) -> None:
        param = next(model.parameters())
        self.model = model
        self.device = param.device
        self.max_model_len = max_model_len
        self.block_size = block_size
        num_blocks = cdiv(max_model_len, block_size) + 1
        self.kv_caches = allocate_kv_caches(
            model, num_blocks, block_size, param.dtype, param.device, attention_backend
        )
        self.block_ids = list(range(1, num_blocks))
        self.num_cached = 0  # positions 0..num_cached-1 hold valid keys and values
        # What was fed, for the lab's tests and the benchmark.
        self.num_forwards = 0
        self.num_tokens_fed = 0
        self.num_resets = 0
        self.positions_fed: list[int] = []

    def reset(self) -> None:
        """Forget the sequence: the cache is treated as empty from now on."""
        self.num_cached = 0
        self.num_resets += 1

    @torch.inference_mode()
    def forward(self, token_ids: list[int], start: int) -> torch.Tensor:
        """Feed ``token_ids`` as positions ``start .. start+len-1``; return the
        logits of the last one ([vocab], float). Positions ``0 .. start-1``
        must already be cached (fed earlier since the last ``reset``)."""
        n = len(token_ids)
        end = start + n
        if n == 0:
            raise ValueError("forward() needs at least one token")
        if start > self.num_cached:
            raise ValueError(
                f"forward(start={start}) but only positions 0..{self.num_cached - 1} are in the "
                f"KV cache (nothing is, after reset()): position {start} would attend to keys "
                f"and values of positions {self.num_cached}..{start - 1} that were never "
                "computed. Feed those tokens first."
            )
        if end > self.max_model_len:
            raise ValueError(
                f"the sequence would reach {end} tokens, more than "
                f"max_model_len={self.max_model_len}"
            )
        bs, dev = self.block_size, self.device
        positions = torch.arange(start, end, dtype=torch.int64, device=dev)
        slots = [self.block_ids[p // bs] * bs + p % bs for p in range(start, end)]
        metadata = AttentionMetadata(
            num_actual_tokens=n,
            max_query_len=n,
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
            max_seq_len=end,
            seq_lens=torch.tensor([end], dtype=torch.int32, device=dev),
            block_table=torch.tensor(
                [self.block_ids[: cdiv(end, bs)]], dtype=torch.int32, device=dev
            ),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        )
        input_ids = torch.tensor(token_ids, dtype=torch.int64, device=dev)
        with set_forward_context(metadata):
            hidden_states = self.model(input_ids, positions)
        logits = self.model.compute_logits(hidden_states[-1:])[0]
        self.num_cached = end
        self.num_forwards += 1
        self.num_tokens_fed += n
        self.positions_fed.extend(range(start, end))
        return logits.float()


# BEGIN LAB 00.1: greedy decoding with and without the KV cache
def greedy_without_cache(
    model: PagedModel, prompt_token_ids: list[int], max_tokens: int
) -> list[int]:
    """The ``max_tokens`` tokens greedy decoding picks after the prompt,
    recomputing the whole sequence at every step (no KV cache reuse)."""
    # HINT: each step: model.reset(), then feed every token so far from position 0.
    # HINT: greedy = the index of the largest logit (int(logits.argmax())).
    tokens = list(prompt_token_ids)
    output: list[int] = []
    for _ in range(max_tokens):
        model.reset()
        logits = model.forward(tokens, start=0)
        token = int(logits.argmax())
        output.append(token)
        tokens.append(token)
    return output


# END LAB 00.1


# BEGIN LAB 00.1: greedy_with_cache: one forward per new token
def greedy_with_cache(model: PagedModel, prompt_token_ids: list[int], max_tokens: int) -> list[int]:
    """The same tokens, computing each position once: prefill the prompt,
    then feed only the newest token at each step."""
    # HINT: reset once, prefill the prompt, then feed [token] at its position.
    # HINT: the last sampled token never needs to be fed.
    model.reset()
    logits = model.forward(list(prompt_token_ids), start=0)
    output: list[int] = []
    for step in range(max_tokens):
        token = int(logits.argmax())
        output.append(token)
        if step + 1 < max_tokens:
            logits = model.forward([token], start=len(prompt_token_ids) + step)
    return output


# END LAB 00.1


# ------------------------------------------------------------------ benchmark


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _prefill_from_scratch(paged: PagedModel, tokens: list[int]) -> None:
    paged.reset()
    paged.forward(tokens, start=0)


def step_times(paged: PagedModel, lengths: list[int], repeats: int, vocab: int) -> list[dict]:
    """ms for the step that produces token L+1 of a context of L tokens: without a
    cache it is a prefill of L tokens; with one, a forward of 1 token at position L-1."""
    rows = []
    for length in lengths:
        tokens = [(17 * i + 5) % vocab for i in range(length)]

        no_ms = _median_ms(partial(_prefill_from_scratch, paged, tokens), repeats)
        paged.reset()
        paged.forward(tokens[:-1], start=0)  # the cache holds positions 0..L-2
        with_ms = _median_ms(partial(paged.forward, tokens[-1:], start=length - 1), repeats)
        rows.append(
            {
                "context": length,
                "no_cache_ms": no_ms,
                "with_cache_ms": with_ms,
                "ratio": no_ms / with_ms,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: SmolLM2-135M GGUF)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 64, 128, 256, 512])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads (default 1: on a small shared machine more threads "
        "mostly wait on each other)",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-save", action="store_true", help="do not write results/*.json")
    args = parser.parse_args(argv)

    from mini_vllm.model_executor.model_loader import load_model, smollm2_gguf_path

    torch.manual_seed(0)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    path = args.model or str(smollm2_gguf_path())
    model, hf_config, _ = load_model(
        path, device=args.device, dtype=torch.float32, load_tokenizer=False
    )
    vocab = hf_config.vocab_size
    max_len = max(max(args.lengths), args.prompt_len + args.max_tokens)
    paged = PagedModel(model, max_len)
    print(
        f"model {Path(path).name} on {args.device}, float32, "
        f"{torch.get_num_threads()} threads; medians of {args.repeats}"
    )

    paged.forward([1, 2, 3], start=0)  # warm-up
    rows = step_times(paged, args.lengths, args.repeats, vocab)
    print(
        f"\none decode step at context length L (ms):\n{'L':>6} {'no cache':>10} "
        f"{'KV cache':>10} {'ratio':>7}"
    )
    for r in rows:
        print(
            f"{r['context']:>6} {r['no_cache_ms']:>10.1f} {r['with_cache_ms']:>10.1f} "
            f"{r['ratio']:>6.1f}x"
        )

    prompt = [(17 * i + 5) % vocab for i in range(args.prompt_len)]
    loops = (("no_cache", greedy_without_cache), ("with_cache", greedy_with_cache))
    times: dict[str, list[float]] = {name: [] for name, _ in loops}
    runs = {}
    for _ in range(3):  # alternate the two loops, keep the medians
        for name, fn in loops:
            before_tokens, start = paged.num_tokens_fed, time.perf_counter()
            out = fn(paged, prompt, args.max_tokens)
            times[name].append((time.perf_counter() - start) * 1e3 / args.max_tokens)
            runs[name] = {"tokens": out, "tokens_fed": paged.num_tokens_fed - before_tokens}
    for name in times:
        runs[name]["ms_per_token"] = statistics.median(times[name])
    same = runs["no_cache"]["tokens"] == runs["with_cache"]["tokens"]
    speedup = runs["no_cache"]["ms_per_token"] / runs["with_cache"]["ms_per_token"]
    print(
        f"\ngenerate {args.max_tokens} tokens after a {args.prompt_len}-token prompt "
        "(medians of 3, alternating):"
    )
    for name, r in runs.items():
        print(f"  {name:>10}: {r['ms_per_token']:7.1f} ms/token, {r['tokens_fed']} tokens fed")
    print(f"  speed-up {speedup:.1f}x, same tokens: {same}")

    if not args.no_save:
        RESULTS.mkdir(exist_ok=True)
        out_path = RESULTS / f"kv_cache_speedup_{torch.device(args.device).type}.json"
        out_path.write_text(
            json.dumps(
                {
                    "model": Path(path).name,
                    "device": args.device,
                    "dtype": "float32",
                    "threads": torch.get_num_threads(),
                    "repeats": args.repeats,
                    "steps": rows,
                    "generate": {
                        "prompt_len": args.prompt_len,
                        "max_tokens": args.max_tokens,
                        "same_tokens": same,
                        "speedup": speedup,
                        **{
                            k: {kk: vv for kk, vv in v.items() if kk != "tokens"}
                            for k, v in runs.items()
                        },
                    },
                },
                indent=1,
            )
            + "\n"
        )
        print(f"wrote {out_path}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
