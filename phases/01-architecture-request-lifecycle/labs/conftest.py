"""Fixtures shared by Phase 01's graded suites.

The real runs use a tiny seeded Llama that carries SmolLM2's tokenizer
(``make_tiny_model(..., tokenizer=True)``): it takes text and produces text
(noise, but real BPE text, so stop strings work) in milliseconds a step.
The notebook runs the same workload on SmolLM2 itself.
"""

from __future__ import annotations

import pytest
import torch

from mini_vllm.model_executor.model_loader import load_model
from mini_vllm.model_executor.model_loader.tiny import make_tiny_model
from mini_vllm.oracle import lifecycle
from mini_vllm.testing import hf_greedy


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny_llama_tok"), arch="llama", seed=0, tokenizer=True
    )


@pytest.fixture(scope="session")
def loaded(tiny_folder):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return load_model(tiny_folder, device=device, dtype=torch.float32)


@pytest.fixture(scope="session")
def workload(loaded):
    return lifecycle.lifecycle_workload(loaded)


@pytest.fixture(scope="session")
def reference_run(loaded, workload):
    """(trace, engine stats) of the reference engine on the lifecycle workload."""
    engine = lifecycle.make_engine(loaded)
    records = lifecycle.trace_run(engine, workload)
    return records, engine.get_stats()


@pytest.fixture
def student_run(impl, loaded, workload, monkeypatch):
    """Runs the lifecycle workload through the student's engine (every Phase
    01 region of ``impl``; see ``lifecycle.student_engine``) and returns
    (trace, engine stats). A region still raising NotImplementedError fails
    the test at once with the lab's message."""

    def run():
        engine = lifecycle.student_engine(impl, loaded, monkeypatch)
        try:
            records = lifecycle.trace_run(engine, workload)
        except NotImplementedError as e:
            pytest.fail(f"{e}: a lab region is not written yet.", pytrace=False)
        return records, engine.get_stats()

    return run


@pytest.fixture(scope="session")
def hf_greedy_tokens(tiny_folder, loaded, workload):
    """{request id: MAX_TOKENS greedy token ids from HF transformers} for the
    workload's prompts, on the same tiny checkpoint."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_folder), dtype=torch.float32).eval()
    tok = loaded.tokenizer
    return {
        rid: hf_greedy(model, tok.encode(prompt), lifecycle.MAX_TOKENS)
        for rid, prompt in workload.prompts.items()
    }
