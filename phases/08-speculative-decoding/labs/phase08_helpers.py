"""Helpers shared by Phase 08's graded suites: calling your code, a
lockstep message that names the step, the request and the field, the chi-square
tail, and SmolLM2 engines with your pieces plugged in.

(Imported by name from the suites: this folder is on sys.path because pytest
puts the folder of ``conftest.py`` there.)
"""

from __future__ import annotations

import dataclasses
import math

from mini_vllm.grading.checks import engine_greedy_tokens, written  # noqa: F401 (the lab tests import it from here)
from mini_vllm.oracle.workload import lockstep_difference  # noqa: F401 (the lab tests import it from here)

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}
# Prompts on which the n-gram drafter fires: patterns SmolLM2 continues (drafts
# accepted) and text whose repeats it does not follow (drafts rejected).
PROMPTS = [
    "red, green, blue, red, green, blue, red, green, blue, red,",
    "The capital of France is Paris. The capital of Italy is Rome. The capital of",
]
MAX_TOKENS = 10


# ------------------------------------------------------------------ Lab 08.3


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X chi-square with ``df`` degrees of freedom, exactly.

    Q(x; 1) = erfc(sqrt(x / 2)), Q(x; 2) = exp(-x / 2), and
    Q(x; k + 2) = Q(x; k) + (x / 2)^(k / 2) exp(-x / 2) / Gamma(k / 2 + 1).
    """
    if x <= 0:
        return 1.0
    half = x / 2
    q, k = (math.erfc(math.sqrt(half)), 1) if df % 2 else (math.exp(-half), 2)
    while k < df:
        q += math.exp((k / 2) * math.log(half) - half - math.lgamma(k / 2 + 1))
        k += 2
    return min(q, 1.0)


# ------------------------------------------------------------------ Lab 08.4


def smollm2_engine(speculative_config: dict | None, reference=None):
    """An LLMEngine on SmolLM2 (float32, chunked prompts);
    given ``reference``, a new engine on its already loaded weights."""
    from mini_vllm.config import SpeculativeConfig
    from mini_vllm.engine.llm_engine import LLMEngine
    from mini_vllm.entrypoints.llm import LLM
    from mini_vllm.model_executor.model_loader import smollm2_gguf_path

    if reference is None:
        llm = LLM(
            str(smollm2_gguf_path()),
            max_model_len=128,
            block_size=16,
            num_gpu_blocks_override=32,
            max_num_batched_tokens=64,
            max_num_seqs=4,
            dtype="float32",
            speculative_config=speculative_config,
        )
        return llm.llm_engine
    spec = None if speculative_config is None else SpeculativeConfig.from_dict(speculative_config)
    config = dataclasses.replace(
        reference.vllm_config,
        cache_config=dataclasses.replace(reference.vllm_config.cache_config),
        speculative_config=spec,
    )
    return LLMEngine(config, (reference.model, reference.hf_config, reference.tokenizer))


def greedy_tokens(engine) -> list[list[int]]:
    """Greedy tokens of PROMPTS through ``engine``, in prompt order."""
    return engine_greedy_tokens(engine, PROMPTS, MAX_TOKENS)


def plug_into_engine(impl, monkeypatch) -> None:
    """Make the engine run your Phase 08 pieces: ``EngineCore`` builds your
    Scheduler and your GPUModelRunner, whose constructor builds your
    NgramProposer; the reference's ``RejectionSampler.forward`` calls your
    ``rejection_sample`` (which calls your ``_write_row`` and
    ``sample_recovered_tokens``)."""
    from mini_vllm.engine import core
    from mini_vllm.sample import rejection_sampler
    from mini_vllm.worker import gpu_model_runner

    monkeypatch.setattr(core, "Scheduler", impl.scheduler.Scheduler)
    monkeypatch.setattr(core, "GPUModelRunner", impl.gpu_model_runner.GPUModelRunner)
    monkeypatch.setattr(gpu_model_runner, "NgramProposer", impl.ngram_proposer.NgramProposer)
    monkeypatch.setattr(
        rejection_sampler, "rejection_sample", impl.rejection_sampler.rejection_sample
    )
