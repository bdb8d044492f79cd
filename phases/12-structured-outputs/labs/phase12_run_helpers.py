"""Helpers for Lab 12.4: SmolLM2 through an engine built from your Phase 12
code, greedy against one JSON schema, and the oracle that checks it:
transformers' logits on the engine's own sequences (teacher forcing), masked
by a fresh xgrammar matcher walked along the engine's tokens.

(Imported by name from the suite: this folder is on sys.path because pytest
puts the folder of ``conftest.py`` there.)
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import torch

from mini_vllm.grading.checks import written

# The JSON schema every request is held to: a closed object with a city from
# a list (the mask overrides SmolLM2 wherever it wants another) and a year.
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo", "Lima", "Cairo"]},
        "year": {"type": "integer", "minimum": 1800, "maximum": 2030},
    },
    "required": ["city", "year"],
    "additionalProperties": False,
}
# 50 prompts "<event> in <city>. JSON:". Chosen from 7 events x 10 cities by
# one reference run: the first 50 whose every output position has a gap of at
# least 0.02 between transformers' top two allowed logits (the engine's and
# transformers' logit gaps agree to within about 4e-5), so that no near-tie
# can flip a token between the two.
PROMPTS = [
    f"{p}. JSON:"
    for p in [
        "a fair in Paris",
        "a flood in Paris",
        "a treaty in Paris",
        "a concert in Paris",
        "an election in Paris",
        "a storm in Paris",
        "a race in Paris",
        "a fair in Rome",
        "a treaty in Rome",
        "a concert in Rome",
        "an election in Rome",
        "a storm in Rome",
        "a race in Rome",
        "a fair in Oslo",
        "a flood in Oslo",
        "a treaty in Oslo",
        "a concert in Oslo",
        "an election in Oslo",
        "a storm in Oslo",
        "a race in Oslo",
        "a fair in Lima",
        "a flood in Lima",
        "a treaty in Lima",
        "a concert in Lima",
        "an election in Lima",
        "a race in Lima",
        "a flood in Cairo",
        "a treaty in Cairo",
        "a storm in Cairo",
        "a fair in Tokyo",
        "a flood in Tokyo",
        "a treaty in Tokyo",
        "a concert in Tokyo",
        "an election in Tokyo",
        "a storm in Tokyo",
        "a fair in Berlin",
        "a flood in Berlin",
        "a treaty in Berlin",
        "a concert in Berlin",
        "an election in Berlin",
        "a storm in Berlin",
        "a race in Berlin",
        "a fair in Madrid",
        "a flood in Madrid",
        "a concert in Madrid",
        "an election in Madrid",
        "a storm in Madrid",
        "a race in Madrid",
        "a flood in Delhi",
        "a treaty in Delhi",
    ]
]
MAX_TOKENS = 32
VOCAB = 49152  # SmolLM2's


@dataclass
class EngineRun:
    """What the engine produced, prompt by prompt."""

    prompt_ids: list[list[int]]
    tokens: list[list[int]]
    texts: list[str]
    finish_reasons: list[str]
    tokenizer: object
    seconds: float
    stats: dict = field(default_factory=dict)


def plug_into_engine(impl, monkeypatch) -> None:
    """Make the engine run your Phase 12 pieces: ``EngineCore`` builds your
    StructuredOutputManager (it hands it to the scheduler), and the runner
    applies the bitmask with your ``apply_grammar_bitmask``. Your Scheduler
    goes in through ``scheduler_cls`` (see ``smollm2_engine``)."""
    from mini_vllm.engine import core
    from mini_vllm.worker import gpu_model_runner

    monkeypatch.setattr(
        core, "StructuredOutputManager", impl.structured_output.StructuredOutputManager
    )
    monkeypatch.setattr(gpu_model_runner, "apply_grammar_bitmask", impl.utils.apply_grammar_bitmask)


def smollm2_engine(scheduler_cls):
    """An LLMEngine on SmolLM2 (float32, on the CPU unless CUDA is there),
    room for every prompt at once (one batch, no preemption)."""
    from mini_vllm.entrypoints.llm import LLM
    from mini_vllm.model_executor.model_loader import smollm2_gguf_path

    llm = LLM(
        str(smollm2_gguf_path()),
        max_model_len=64,
        max_num_seqs=len(PROMPTS),
        max_num_batched_tokens=1024,
        kv_cache_memory_bytes=256 << 20,
        dtype="float32",
        scheduler_cls=scheduler_cls,
    )
    return llm.llm_engine


def generate(engine, max_steps: int = 4 * MAX_TOKENS) -> EngineRun:
    """Greedy, every prompt held to SCHEMA; the engine stepped by hand (a
    run that stops advancing fails after ``max_steps`` steps)."""
    import pytest

    from mini_vllm.sampling_params import SamplingParams, StructuredOutputsParams

    tokenizer = engine.tokenizer
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )
    start = time.perf_counter()
    for i, ids in enumerate(prompt_ids):
        written(engine.add_request, str(i), {"prompt_token_ids": ids}, params)
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in written(engine.step):
            if out.finished:
                done[out.request_id] = out.outputs[0]
    else:
        pytest.fail(
            f"after {max_steps} engine steps, {len(PROMPTS) - len(done)} of {len(PROMPTS)} "
            f"requests are unfinished (max_tokens is {MAX_TOKENS}): a request waits for its "
            "grammar forever or is never scheduled again (Lab 12.1)."
        )
    outs = [done[str(i)] for i in range(len(PROMPTS))]
    return EngineRun(
        prompt_ids=prompt_ids,
        tokens=[list(o.token_ids) for o in outs],
        texts=[o.text for o in outs],
        finish_reasons=[str(o.finish_reason) for o in outs],
        tokenizer=tokenizer,
        seconds=time.perf_counter() - start,
        stats=engine.get_stats(),
    )


def transformers_smollm2():
    """SmolLM2 in transformers, float32. From the folder mini_vllm's GGUF cache
    keeps (config.json and the dequantized weights, HF-named: read in well
    under a second), or from the GGUF itself when the cache is off."""
    from transformers import AutoModelForCausalLM

    from mini_vllm.model_executor.model_loader import gguf_cache, smollm2_gguf_path

    path = smollm2_gguf_path()
    root = gguf_cache.cache_dir()
    entry = None if root is None else gguf_cache.entry_dir(root, path)
    if entry is not None and gguf_cache.entry_problem(entry, gguf_cache.source_of(path)) is None:
        model = AutoModelForCausalLM.from_pretrained(str(entry), dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    return model.eval()


def teacher_forced_logits(hf, run: EngineRun) -> list[torch.Tensor]:
    """transformers' logits at each output position of each prompt, float
    ``[len(tokens), vocab]``: one forward over every (prompt + engine output)
    sequence, right-padded with an attention mask (causal attention: a
    position never sees the padding after it). Row k is the model's opinion
    of output token k, having seen the prompt and output tokens 0..k-1."""
    seqs = [p + t for p, t in zip(run.prompt_ids, run.tokens, strict=True)]
    width = max(map(len, seqs))
    input_ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        input_ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    with torch.no_grad():
        hidden = hf.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
        rows = [
            hidden[i, len(p) - 1 : len(p) - 1 + len(t)]
            for i, (p, t) in enumerate(zip(run.prompt_ids, run.tokens, strict=True))
        ]
        logits = hf.lm_head(torch.cat(rows)).float()  # only the rows we need
    return list(logits.split([len(t) for t in run.tokens]))


def schema_matcher_factory(tokenizer):
    """A function returning a FRESH xgrammar matcher for SCHEMA each call,
    compiled as mini_vllm's backend compiles a JSON schema (the schema's JSON
    text, any whitespace, the same tokenizer and vocabulary size)."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB)
    ctx = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=True)
    return lambda: xgr.GrammarMatcher(ctx)
