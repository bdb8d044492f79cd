"""Structured outputs: what a grammar costs, against the forward pass.

Three numbers, one run, SmolLM2-135M on this machine:
- compile: a JSON schema compiled against SmolLM2's 49152-token vocabulary
  (a fresh xgrammar compiler each time, so no cache hit), median of
  ``--compiles`` runs; and building the compiler's TokenizerInfo once;
- per step, with ``--requests`` JSON-constrained requests decoding together:
  filling the bitmask (``Scheduler.get_grammar_bitmask``) and applying it to
  the logits (``apply_grammar_bitmask``), medians over the steps that sample
  every request, beside that step's ``execute_model`` (the forward pass,
  logits, the mask and sampling);
- the same prompts unconstrained (same max_tokens, ``ignore_eos``): the
  median ``execute_model`` of its decode steps with the same batch size, the
  baseline;
- on the same steps, xgrammar's own CPU kernel (``apply_token_bitmask_inplace``,
  what upstream's ``apply_grammar_bitmask`` calls) applying the same rows to a
  copy of the same logits: the price of mini_vllm unpacking the bits in torch.

Usage: ``python -m mini_vllm.benchmarks.structured_output [--requests 16]``;
prints one JSON object (threads and load average included).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import mini_vllm.worker.gpu_model_runner as runner_module
from mini_vllm.entrypoints.llm import LLM
from mini_vllm.model_executor.model_loader import smollm2_gguf_path
from mini_vllm.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo", "Lima"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def time_compiles(tokenizer, vocab_size: int, n: int) -> dict:
    import xgrammar as xgr

    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    tokenizer_info_s = time.perf_counter() - start
    times = []
    for _ in range(n):
        compiler = xgr.GrammarCompiler(info, max_threads=8, cache_enabled=False)
        start = time.perf_counter()
        compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=True)
        times.append(time.perf_counter() - start)
    return {
        "tokenizer_info_s": tokenizer_info_s,
        "json_schema_compile_median_s": statistics.median(times),
    }


class StepTimer:
    """Per step: bitmask fill, bitmask apply and execute_model wall times."""

    def __init__(self, llm: LLM) -> None:
        core = llm.llm_engine.engine_core
        self.steps: list[dict] = []
        self.current: dict = {}
        scheduler, runner = core.scheduler, core.model_runner
        fill, execute, apply = (
            scheduler.get_grammar_bitmask,
            runner.execute_model,
            runner_module.apply_grammar_bitmask,
        )

        def timed_fill(scheduler_output):
            start = time.perf_counter()
            out = fill(scheduler_output)
            self.current = {"fill": time.perf_counter() - start, "apply": 0.0}
            return out

        def timed_apply(scheduler_output, grammar_output, input_batch, logits):
            import xgrammar as xgr

            # float [num_logits, V]; int32 [rows, words]. Rows are not reordered to the
            # batch here: the kernel costs the same, and tests check the results.
            copy = logits.clone()
            bitmask = torch.from_numpy(grammar_output.grammar_bitmask)
            start = time.perf_counter()
            apply(scheduler_output, grammar_output, input_batch, logits)
            self.current["apply"] = time.perf_counter() - start
            if bitmask.shape[0] == copy.shape[0]:
                start = time.perf_counter()
                xgr.apply_token_bitmask_inplace(copy, bitmask)
                self.current["xgrammar_apply"] = time.perf_counter() - start

        def timed_execute(scheduler_output, *args):
            start = time.perf_counter()
            out = execute(scheduler_output, *args)
            self.current["execute"] = time.perf_counter() - start
            self.current["num_reqs"] = len(scheduler_output.num_scheduled_tokens)
            self.current["decode"] = scheduler_output.total_num_scheduled_tokens == len(
                scheduler_output.num_scheduled_tokens
            )
            self.steps.append(self.current)
            return out

        scheduler.get_grammar_bitmask = timed_fill
        runner.execute_model = timed_execute
        runner_module.apply_grammar_bitmask = timed_apply


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--compiles", type=int, default=5)
    args = parser.parse_args()

    llm = LLM(str(smollm2_gguf_path()), max_model_len=512)
    tokenizer = llm.get_tokenizer()
    result = {
        "threads": torch.get_num_threads(),
        "load_average_before": os.getloadavg(),
        **time_compiles(tokenizer, llm.llm_engine.hf_config.vocab_size, args.compiles),
    }
    prompts = [
        {
            "prompt_token_ids": tokenizer.apply_chat_template(
                [{"role": "user", "content": f"Describe person number {i} as JSON."}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        }
        for i in range(args.requests)
    ]
    timer = StepTimer(llm)
    constrained = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )
    llm.generate(prompts, constrained, use_tqdm=False)
    full = [s for s in timer.steps if s["decode"] and s["num_reqs"] == args.requests]
    timer.steps.clear()
    plain = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, plain, use_tqdm=False)
    base = [s for s in timer.steps if s["decode"] and s["num_reqs"] == args.requests]

    def median_ms(steps, key):
        return 1e3 * statistics.median(s[key] for s in steps)

    fill, apply = median_ms(full, "fill"), median_ms(full, "apply")
    xgrammar_apply = median_ms(full, "xgrammar_apply")
    execute, baseline = median_ms(full, "execute"), median_ms(base, "execute")
    result.update(
        {
            "batch": args.requests,
            "constrained_decode_steps": len(full),
            "baseline_decode_steps": len(base),
            "fill_median_ms": fill,
            "apply_median_ms": apply,
            "xgrammar_kernel_apply_median_ms": xgrammar_apply,
            "apply_over_xgrammar_kernel": apply / xgrammar_apply,
            "execute_model_median_ms": execute,
            "baseline_execute_model_median_ms": baseline,
            "fill_over_baseline_execute": fill / baseline,
            "apply_over_baseline_execute": apply / baseline,
            "constrained_over_baseline_execute": execute / baseline,
            "load_average_after": os.getloadavg(),
        }
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
