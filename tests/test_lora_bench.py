"""The Phase 11 benchmark measures what it says (mini_vllm/benchmarks/lora.py).

On the tiny seeded Llama, at a tiny setting (rank 8, two adapters, three
rows, three tokens, one round):

- it writes its result file with every case it names (the base engine, the
  LoRA engine with no adapter, and mixed and separate for each count);
- the mixed batch and the separate batches do the same work: every row gets
  the same greedy tokens in both, base rows get the base engine's tokens,
  and adapter rows get other tokens (the adapters are applied, or the times
  would compare nothing);
- the rows cycle over the adapters and the base model as the docstring says,
  and ``separate`` runs one batch per adapter plus one for the base rows.
"""

from __future__ import annotations

import json

import pytest
from serve_helpers import tiny_text_model

from mini_vllm.benchmarks import lora as bench


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_bench")
    argv = ["--model", tiny_text_model(), "--ranks", "8", "--counts", "2"]
    argv += ["--rows", "3", "--prompt-len", "4", "--tokens", "3", "--repeats", "1"]
    returned = bench.main([*argv, "--out", str(out)])
    written = json.loads((out / "lora_cpu.json").read_text())
    assert written["cases"] == returned["cases"]
    return written


def _case(result, name, rank):
    (case,) = [c for c in result["cases"] if c["case"] == name and c["rank"] == rank]
    return case


def test_every_case_is_measured(result):
    names = [(c["case"], c["rank"]) for c in result["cases"]]
    assert names == [
        ("base", None),
        ("no adapter", 8),
        ("mixed 2", 8),
        ("separate 2", 8),
    ]
    for case in result["cases"]:
        assert case["decode_step_ms"] > 0, f"{case['case']}: no decode step was timed"
        assert case["decode_step_cpu_ms"] > 0, f"{case['case']}: no CPU time was taken"
    assert _case(result, "base", None)["cpu_vs_base"] == 1.0


def test_mixed_and_separate_do_the_same_work(result):
    base = _case(result, "base", None)["tokens"]
    assert _case(result, "no adapter", 8)["tokens"] == base, (
        "the LoRA engine with no adapter must give the base engine's tokens"
    )
    for n in (2,):
        mixed, separate = _case(result, f"mixed {n}", 8), _case(result, f"separate {n}", 8)
        assert mixed["rows"] == separate["rows"]
        assert mixed["tokens"] == separate["tokens"], (
            f"{n} adapter(s): a row's tokens depend on how the rows were batched"
        )
        for i, adapter in enumerate(mixed["rows"]):
            if adapter is None:
                assert mixed["tokens"][i] == base[i], f"row {i} has no adapter: base tokens"
            else:
                assert mixed["tokens"][i] != base[i], (
                    f"row {i} runs {adapter} but gets the base model's tokens"
                )


def test_rows_cycle_over_the_adapters_and_the_base(result):
    assert _case(result, "mixed 2", 8)["rows"] == ["r8-0", "r8-1", None]
    assert bench.cycle_rows(["a"], 3) == ["a", None, "a"]
    # one batch per adapter, then one for the base rows
    assert bench.groups_of(["a", "b", None, "a"]) == [[0, 3], [1], [2]]
    assert len(_case(result, "separate 2", 8)["group_decode_ms"]) == 3
