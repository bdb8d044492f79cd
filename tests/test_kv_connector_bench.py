"""``python -m mini_vllm.benchmarks.kv_connector`` runs, at a tiny setting.

On the tiny seeded Llama with SmolLM2's tokenizer: both parts produce their
numbers, the pair gives as many tokens as the single engine, the proxy saw
one hand-off per request (and the blocks they named), and the stored-prefix
pass found the files the miss pass saved.
"""

from __future__ import annotations

import json

import pytest
from serve_helpers import tiny_text_model

from mini_vllm.benchmarks import kv_connector


@pytest.mark.deep  # three server processes and three engines: ~100 s on 2 busy cores
def test_the_benchmark_runs_at_a_tiny_setting(tmp_path):
    argv = ["--model", tiny_text_model(), "--num-requests", "2", "--prompt-len", "40"]
    argv += ["--output-len", "4", "--concurrency", "2", "--out", str(tmp_path)]
    report = kv_connector.main(argv)
    assert json.loads((tmp_path / "kv_connector.json").read_text()) == report
    storage = report["storage"]
    assert set(storage["ttft_s"]) == {"no_connector", "miss_and_save", "stored_hit"}
    assert storage["files_stored"] > 0
    pair = report["pair"]
    assert pair["single"]["tokens"] == pair["pair"]["tokens"] == 2 * 4
    # 40-ish-token prompts at block size 16: at least one block each, every request handed over.
    assert pair["transfers"]["requests"] == 2 and pair["transfers"]["blocks"] >= 2
    assert pair["transfers"]["bytes"] == pair["transfers"]["blocks"] * storage["block_bytes"]
